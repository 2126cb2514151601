"""The known-good store over random sequences of what happens to it (issue #31): restarts that verify and record
what is on disk, deploys of differing configurations and software generations, the operator's rollback, records
damaged on disk, and pruning to `keep`. A model written apart from the store says what each step must find:

- the operator's rollback puts back the newest verified generation that is not the configuration on disk now;
- the newest readable generation is the known-good one (a damaged record is skipped, never fatal);
- a generation's sequence number is above every one issued before, pruning or not;
- at most `keep` generations are kept, the newest ones.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import Instance
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.known_good import Store
from support.modules import instance_record

CONFIGS = st.integers(0, 3)  # few enough that configurations recur, as profiles do
SOFTWARE = st.integers(0, 2)  # the unit names its virtualenv: a software generation is part of the files
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("deploy"), CONFIGS, SOFTWARE),
        st.tuples(st.just("restart")),
        st.tuples(st.just("rollback")),
        st.tuples(st.just("damage"), st.integers(0, 9)),
    ),
    max_size=30,
)


def files_of(config: int, software: int) -> tuple[str, str]:
    unit = f"[Service]\nExecStart=/opt/sglang-sw{software}/bin/python -m sglang.launch_server\n"
    return unit, f'PROFILE="p{config}"\n'


@dataclass
class Model:
    """What the store must hold: (sequence, configuration, damaged) of each kept generation, oldest first."""

    keep: int
    kept: list[list] = field(default_factory=list)
    issued: int = 0

    def record(self, config: tuple[int, int]) -> int:
        self.issued = max([self.issued, *(seq for seq, _, _ in self.kept)]) + 1
        self.kept.append([self.issued, config, False])
        del self.kept[: -self.keep]
        return self.issued

    def target(self, on_disk: tuple[int, int]) -> tuple[int, int] | None:
        readable = [c for _, c, damaged in reversed(self.kept) if not damaged]
        return next((c for c in readable if c != on_disk), None)

    def newest(self) -> tuple[int, int] | None:
        return next((c for _, c, damaged in reversed(self.kept) if not damaged), None)


def instance(root: Path) -> Instance:
    argv = ["/opt/sglang-sw0/bin/python", "-m", "sglang.launch_server"]
    return Instance.from_params(instance_record(root, argv=argv, profile="p0", state_dir=str(root / "state")))


def put(inst: Instance, config: tuple[int, int]) -> None:
    for path, text in zip((inst.unit_path, inst.env_path), files_of(*config), strict=True):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)


def config_of(record: dict | None, inst: Instance) -> tuple[int, int] | None:
    if record is None:
        return None
    unit, env = record["files"][inst.unit_path], record["files"][inst.env_path]
    return int(env.split('"p')[1].split('"')[0]), int(unit.split("sglang-sw")[1].split("/")[0])


@settings(max_examples=300, deadline=None)
@given(keep=st.integers(1, 5), steps=STEPS)
def test_the_operators_rollback_is_always_the_newest_verified_generation_not_on_disk(keep, steps):
    with tempfile.TemporaryDirectory() as tmp:
        inst = instance(Path(tmp))
        store, model = Store(inst, keep=keep), Model(keep)
        on_disk = (0, 0)
        put(inst, on_disk)
        for step in steps:
            if step[0] == "deploy":
                on_disk = (step[1], step[2])
                put(inst, on_disk)
            elif step[0] == "restart":  # started and verified: what is on disk recorded
                summary = store.record(store.snapshot(), inst.argv, {})
                assert int(summary["generation"].split("-")[0]) == model.record(on_disk)
            elif step[0] == "rollback":
                target = store.rollback_target()
                assert config_of(target, inst) == model.target(on_disk)
                if target is not None:  # put back, started, verified and recorded anew, as restart.rollback does
                    store.restore(target)
                    on_disk = config_of(target, inst)
                    model.record(on_disk)
                    store.record(store.snapshot(), inst.argv, {})
            elif model.kept:  # damage: one kept record's file cut short on disk
                i = step[1] % len(model.kept)
                paths = store.records()
                Path(paths[i]).write_text('{"generation": ')
                model.kept[i][2] = True
            assert [int(Path(p).name.split("-")[0]) for p in store.records()] == [s for s, _, _ in model.kept]
            assert config_of(store.latest(), inst) == model.newest()
