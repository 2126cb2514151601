"""sglang-deploy's host-side logic, shipped by Ansible with the modules in plugins/modules/.

One file per concern, so that where a phase, a check or an outcome lives shows from
the names alone:

    outcomes   the names of outcomes and phases (shared with the driver and playbooks)
    gpu        nvidia-smi: GPUs, compute processes, the wait for clean GPUs (also the unit's gate)
    procinfo   a process's command line, user and systemd unit, from /proc
    unit       systemd and the journal: state, start/stop, the cause of a failure
    http       the server's HTTP API: health, generation, server_info, metrics
    instance   one instance's rendered record: unit name, paths, argv, GPUs, port
    lock       the per-instance operation lock (flock under /run)
    known_good known-good generations: what started and verified, with its software
    stage      staged configuration: pending files, promoted by the safe restart
    checks     verify's checks
    restart    the state machine: restart, rollback, verify, status
    validate   configuration checks with SGLang's own parser
    patch      the atomic, recorded patch series
    software   software generations (one virtualenv per lock)
    router     the gateways' worker API (smg, sglang-router) and the drain
    gateways   an action on every gateway at once, with a quorum
    discovery  smg's discovery file: the workers declared, edited under a lock
    sentinel   the hung-worker sentinel beside each gateway (run on the gateway's host)

Nothing here imports Ansible: the modules are thin adapters over these. On the controller everything (the
modules, the filter and action plugins, the driver, the unit tests) imports them by one name, as the collection
sglang.deploy ships them: ``ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.X`` (from a
checkout, collections/ on sys.path). On the hosts, the gate, the launcher and the sentinel import the copies
installed beside them as ``sglang_deploy.X``. Imports between these files are relative, so both names work.
"""
