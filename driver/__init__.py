"""sglang-deploy's driver: `python -m driver deploy|restart|verify|validate|status|rollback|history`.

Each command maps to a playbook (driver/commands.py), run through ansible-runner in one
place (driver/runner.py); its event stream drives the progress display and the summary
(driver/events.py, driver/display.py); every run is kept in a local SQLite ledger
(driver/ledger.py). Heavy imports (ansible-runner, rich) wait until a command runs, so
`--help` answers at once.
"""
