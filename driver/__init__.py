"""sglang-deploy's driver: `python -m driver deploy|restart|verify|validate|status|rollback|history`.

Each command maps to a playbook (driver/cli.py); the inventory and --limit are checked with Ansible's own
loader first (driver/inventory.py); the playbook runs through ansible-runner in one place (driver/runner.py);
its event stream drives the progress display and the summary (driver/events.py, driver/display.py); Ctrl-C
is handled in driver/interrupts.py; every run is kept in a private local SQLite ledger (driver/ledger.py),
its secrets redacted (driver/redact.py). Heavy imports (ansible, ansible-runner, rich) wait until a command
runs, so `--help` answers at once.
"""
