"""sglang-deploy's driver: `python -m driver deploy|restart|verify|validate|status|rollback|history` from a
checkout, `sglang-deploy ...` installed (pip install .; driver/paths.py says where each finds the collection).

Each command maps to a playbook (driver/cli.py); the inventory and --limit are checked with Ansible's own
loader first (driver/inventory.py); the playbook runs through ansible-runner in one place (driver/runner.py);
its event stream drives the progress display and the summary (driver/events.py, driver/display.py); Ctrl-C
is handled in driver/interrupts.py; every run is kept in a private local SQLite ledger (driver/ledger.py),
its secrets redacted (driver/redact.py). Heavy imports (ansible, ansible-runner, rich) wait until a command
runs, so `--help` answers at once.
"""

import sys
from pathlib import Path

# The host logic is the collection's, imported by one name (ansible_collections.sglang.deploy.plugins.module_utils.
# sglang_deploy) here as in the modules and plugins: from a checkout, its collections/ (the symlink tree onto this
# repository, as ansible.cfg's collections_path has it) comes first on the import path, ahead of any installed copy.
# Installed (pip install .), there is no such directory: the collection is in site-packages beside the driver.
_COLLECTIONS = Path(__file__).resolve().parents[1] / "collections"
if (_COLLECTIONS / "ansible_collections").is_dir() and str(_COLLECTIONS) not in sys.path:
    sys.path.insert(0, str(_COLLECTIONS))
