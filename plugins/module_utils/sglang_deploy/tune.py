"""Autotune's logic (issue 15): a sweep's plan, its ranking, the winner as a profile file, the plot.

A sweep varies flags (snake_case, as profiles write them: ``speculative_num_steps``) and environment
variables (upper case: ``NCCL_ALGO``) over a starting profile. ``plan`` expands the grid, drops every
combination SGLang 0.5.23 would refuse or that would start the same server as another (each with its
reason), and always puts the no-speculation baseline first. The combinations are named by a hash of what
they change, so a sweep interrupted and run again finds the ones it measured. ``rank`` orders the
measurements and marks those slower than the baseline; ``profile_file`` writes the winner as a new named
profile; ``svg`` draws tok/s against accept length.

No Ansible and no I/O here: plugins/filter/sglang_config.py plans inside the play, driver/tune.py runs the
sweep, the safe restart measures (plugins/module_utils/sglang_deploy/bench.py, run by restart.measure under its lock).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field

from .secret_rule import secret_name

# A profile named sglang_tuned_profile_<name> anywhere in the variables (a group_vars file the sweep
# wrote, or the sweep's own extra variable for the combination it runs) is profile <name>.
TUNED_PREFIX = "sglang_tuned_profile_"
BASELINE = "tune_no_spec"
PREFIX = "tune_"
SPEC = "speculative_"
STEPS, TOPK, DRAFT = "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"
ALGORITHM = "speculative_algorithm"
EAGLE_FAMILY = ("EAGLE", "EAGLE3", "NEXTN")
ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
FLAG_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# SGLang 0.5.23, speculative_hook.py: page trees with topk > 1 only on these attention backends.
PAGE_TREE_BACKENDS = ("flashinfer", "fa3", "triton")


class GridError(ValueError):
    """The grid cannot be swept: the message names the key or value and what to do."""


def value_of(text: str):
    """A grid value as YAML would read it: an int, a float, true/false, empty (unset), else the string."""
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    for kind in (int, float):
        try:
            return kind(t)
        except ValueError:
            pass
    return t


def parse_grid(items: list[str], base: dict | None = None) -> dict[str, list]:
    """--grid key=v1,v2 (repeatable) on top of a grid file's {key: [values]}: {key: [values]}, in order."""
    grid: dict[str, list] = {}
    for key, values in (base or {}).items():
        grid[str(key)] = list(values) if isinstance(values, (list, tuple)) else [values]
    for item in items:
        key, sep, rest = item.partition("=")
        key = key.strip().replace("-", "_") if not ENV_NAME.match(key.strip()) else key.strip()
        if not sep or not key:
            raise GridError(f"--grid {item!r}: write it as key=value1,value2 (for example speculative_num_steps=1,3)")
        grid[key] = [value_of(v) for v in rest.split(",")]
    for key, values in grid.items():
        if not (FLAG_NAME.match(key) or ENV_NAME.match(key)):
            raise GridError(
                f"grid key {key!r}: a flag as profiles write it (speculative_num_steps) or an environment "
                "variable (NCCL_ALGO)"
            )
        if not values:
            raise GridError(f"grid key {key!r} has no values")
        # Its values would be secrets (SGLang's --api-key, a token), which the sweep's labels, ledger and profile
        # file would show (secret_rule: the one rule of what names a secret).
        if secret_name(key):
            raise GridError(f"grid key {key!r} names a secret: a sweep shows its values everywhere; set it as a secret")
        if len({json.dumps(v) for v in values}) != len(values):
            raise GridError(f"grid key {key!r} lists a value twice: {values}")
    if not grid:
        raise GridError("an empty grid: give --grid key=v1,v2 (repeatable) or --grid-file")
    return grid


@dataclass
class Combination:
    name: str
    flags: dict = field(default_factory=dict)  # changed flags; None removes the flag
    env: dict = field(default_factory=dict)  # changed variables; None removes the variable
    values: dict = field(default_factory=dict)  # the grid's values as given (what the tables show)
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.name == BASELINE:
            return "no speculation"
        return " ".join(f"{short(k)}={'-' if v in (None, '') else v}" for k, v in self.values.items())

    def as_dict(self) -> dict:
        return {"name": self.name, "flags": self.flags, "env": self.env, "values": self.values, "label": self.label}

    def profile(self, start: dict, origin: str) -> dict:
        """The starting profile with this combination's changes: what the restart runs. A removed flag or variable
        stays as null, so that it also unsets what sglang_server_flags or sglang_server_env set."""
        flags = {**(start.get("flags") or {}), **self.flags}
        env = {**(start.get("env") or {}), **self.env}
        out = {"description": f"{origin}: {self.label}", "flags": flags}
        if env:
            out["env"] = env
        return out


SHORT = {STEPS: "steps", TOPK: "topk", DRAFT: "draft", "cuda_graph_max_bs_decode": "graph_bs"}


def short(key: str) -> str:
    return SHORT.get(key, key)


def name_of(flags: dict, env: dict) -> str:
    digest = hashlib.sha256(json.dumps([flags, env], sort_keys=True, default=str).encode()).hexdigest()
    return PREFIX + digest[:8]


def _int(effective: dict, key: str):
    v = effective.get(key)
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise GridError(f"{key}={v!r}: SGLang takes a whole number") from None


def refusal(effective: dict) -> str | None:
    """Why SGLang 0.5.23 (or the draft tree) rules this speculative configuration out, or None."""
    steps, topk, draft = _int(effective, STEPS), _int(effective, TOPK), _int(effective, DRAFT)
    for key, v, least in ((STEPS, steps, 1), (TOPK, topk, 1), (DRAFT, draft, 2)):
        if v is not None and v < least:
            return f"{key}={v}: at least {least} for EAGLE-family speculation"
    if steps is not None and topk is not None and draft is not None and draft > steps * topk + 1:
        return (
            f"{draft} draft tokens, more than the draft tree holds ({STEPS} x {TOPK} + 1 = {steps * topk + 1}): "
            "SGLang's bench_speculative.py skips it"
        )
    backend = effective.get("attention_backend")
    if topk and topk > 1 and backend == "trtllm_mha":
        return "trtllm_mha backend only supports topk = 1 for speculative decoding (SGLang 0.5.23)"
    if topk and topk > 1 and effective.get("speculative_use_rejection_sampling"):
        return "--speculative-use-rejection-sampling requires --speculative-eagle-topk=1 (SGLang 0.5.23)"
    page = effective.get("page_size")
    if topk and topk > 1 and page and int(page) > 1 and backend and backend not in PAGE_TREE_BACKENDS:
        return (
            f"speculative_eagle_topk > 1 with page_size > 1 is only supported on {PAGE_TREE_BACKENDS} (SGLang 0.5.23)"
        )
    return None


def plan(start_flags: dict, start_env: dict, grid: dict[str, list], fixed: dict | None = None):
    """(combinations, dropped): the baseline first, then each distinct server the grid gives, in grid order.

    start_flags/start_env: what the starting configuration runs (common flags, profile, instance merged);
    fixed: {key: the variable that sets it} for keys the sweep cannot vary (an instance's own flags win over
    any profile). dropped: [{values, reason}].
    """
    for key in grid:
        if key in (fixed or {}):
            raise GridError(
                f"grid key {key!r} is set by {fixed[key]}, which overrides every profile: move it into the profile"
            )
    spec_keys = sorted({k for k in [*start_flags, *grid] if k.startswith(SPEC) and not ENV_NAME.match(k)})
    baseline = Combination(BASELINE, flags={k: None for k in spec_keys}, values={k: None for k in spec_keys})
    out, dropped, seen = [baseline], [], {}
    keys = list(grid)
    for combo in itertools.product(*(grid[k] for k in keys)):
        values = dict(zip(keys, combo, strict=True))
        flags = {k: v for k, v in values.items() if not ENV_NAME.match(k)}
        env = {k: (None if v == "" else str(v)) for k, v in values.items() if ENV_NAME.match(k)}
        flags = {k: (None if v == "" else v) for k, v in flags.items()}
        effective = {k: v for k, v in {**start_flags, **flags}.items() if v is not None}
        notes = []
        if any(k.startswith(SPEC) for k in flags) and effective.get(ALGORITHM) is None:
            raise GridError(
                f"the grid varies {', '.join(k for k in flags if k.startswith(SPEC))} but the starting profile "
                f"has no {ALGORITHM}: start from a speculative profile or put {ALGORITHM} in the grid"
            )
        if str(effective.get(ALGORITHM, "")).upper() in EAGLE_FAMILY:
            steps, topk = _int(effective, STEPS), _int(effective, TOPK)
            if topk == 1 and steps is not None and _int(effective, DRAFT) not in (None, steps + 1):
                # SGLang 0.5.23 (_handle_eagle_family) does this itself: the server it starts has steps + 1.
                notes.append(f"{DRAFT} {effective[DRAFT]} -> {steps + 1}: SGLang sets steps + 1 when topk is 1")
                flags = {**flags, DRAFT: steps + 1}
                effective[DRAFT] = steps + 1
            why = refusal(effective)
            if why:
                dropped.append({"values": values, "reason": why})
                continue
        key = json.dumps([{k: effective.get(k) for k in sorted(set(effective) | set(flags))}, env], sort_keys=True)
        if key in seen:
            reason = f"the same server as {seen[key].label}"
            reason += f" ({notes[0]})" if notes else ""
            dropped.append({"values": values, "reason": reason})
            continue
        c = Combination(name_of(flags, env), flags=flags, env=env, values=values, notes=notes)
        seen[key] = c
        out.append(c)
    return out, dropped


def sweep_id(host: str, instance: str, start: str, grid: dict, bench: dict, fingerprint: str = "") -> str:
    """The sweep's identity: a re-run with the same host, instance, start, grid and benchmark, from the same
    configuration and software (the plan's fingerprint), resumes it."""
    doc = json.dumps([host, instance, start, grid, bench, fingerprint], sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).hexdigest()[:12]


def fingerprint(start_flags: dict, start_env: dict, identity=None) -> str:
    """What a sweep starts from, as the plan sees it: the starting configuration's flags and environment, and the
    identity the play names (the software the units run, the model)."""
    doc = json.dumps([start_flags, start_env, identity], sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).hexdigest()[:12]


def score(m: dict) -> float | None:
    return m.get("output_tokens_per_s")


LEVEL_FIGURES = ("output_tokens_per_s", "accept_length", "ttft_median_s", "ttft_p99_s", "itl_median_s", "itl_p99_s")
# A level's repeats: tok/s's interval and samples (the ranking's), every figure's intervals and samples.
LEVEL_NOISE = ("interval", "samples", "intervals", "figure_samples")


def at_level(result: dict, concurrency: int | None) -> dict:
    """The result as measured at `concurrency` (its benchmark's level: its figures, tok/s's `interval` and `samples`,
    every figure's `intervals` and `figure_samples`); at None, its own figures (the first level's). A concurrency
    its benchmark did not run: nothing measured."""
    levels = (result.get("bench") or {}).get("levels") or []
    if concurrency is None:
        level = levels[0] if levels else {}
        return {**result, **{k: level.get(k) for k in LEVEL_NOISE}}
    level = next((lv for lv in levels if lv.get("concurrency") == concurrency), None) or {}
    figures = {k: level.get(k) for k in LEVEL_FIGURES + LEVEL_NOISE}
    return {**result, **figures}


def rank(results: list[dict], concurrency: int | None = None) -> list[dict]:
    """The results ranked by output tok/s at `concurrency` (None: each one's first level; measured first, failed
    last), each with its figures there, its rank, its ratio to the baseline and `slower_than_baseline` (a
    speculative combination below no speculation)."""
    results = [at_level(r, concurrency) for r in results]
    base = next((r for r in results if r["name"] == BASELINE and score(r) is not None), None)
    ranked = sorted(results, key=lambda r: (score(r) is None, -(score(r) or 0.0)))
    out = []
    for i, r in enumerate(ranked, 1):
        s = score(r)
        ratio = round(s / score(base), 3) if base and s is not None and score(base) else None
        slower = bool(r["name"] != BASELINE and ratio is not None and ratio < 1.0)
        out.append({**r, "rank": i if s is not None else None, "vs_baseline": ratio, "slower_than_baseline": slower})
    return out


# decide()'s verdicts
WINNER, NO_DIFFERENCE, BASELINE_FASTEST, NO_BASELINE = (
    "winner",
    "no_significant_difference",
    "baseline_fastest",
    ("no_baseline"),
)
MARGIN = 0.02  # how far a winner's interval must clear the others' (a fraction of their upper bound)


def decide(ranked: list[dict], margin: float = MARGIN) -> dict:
    """{verdict, winner, best, why}: a winner only when the fastest combination's interval (its repeats' 95 %
    t-interval) clears both no speculation's and the runner-up's upper bound by `margin` (0.02: 2 % above them).
    Otherwise no winner: no speculation not measured (nothing to beat), no speculation the fastest, or no
    significant difference (the intervals within the margin of each other, or a figure without an interval: one
    measurement says nothing of its noise). `best`: the fastest speculative combination, winner or not."""
    measured = [r for r in ranked if score(r) is not None]
    base = next((r for r in measured if r["name"] == BASELINE), None)
    best = next((r for r in measured if r["name"] != BASELINE), None)
    out = {"winner": None, "best": best, "margin": margin}
    if base is None:
        return {**out, "verdict": NO_BASELINE, "why": "no speculation was not measured: nothing to beat"}
    if best is None or measured[0] is base:
        return {**out, "verdict": BASELINE_FASTEST, "why": f"no speculation is the fastest ({score(base)} tok/s)"}
    runner = measured[1]
    missing = [r["name"] for r in (best, runner, base) if not r.get("interval")]
    if missing:
        why = f"no interval for {', '.join(dict.fromkeys(missing))}: one measurement each says nothing of the noise"
        return {**out, "verdict": NO_DIFFERENCE, "why": why}
    low = best["interval"][0]
    bar = max(base["interval"][1], runner["interval"][1])
    if low > bar * (1 + margin):
        whose = f"{runner['label']}'s" if runner is base else f"{runner['label']}'s and no speculation's"
        why = f"{best['label']}: {score(best)} tok/s [{low}, {best['interval'][1]}] clears {whose} intervals (up to {bar}) by more than {margin:.0%}"
        return {**out, "winner": best, "verdict": WINNER, "why": why}
    others = [runner] if runner is base else [runner, base]  # the runner-up may be no speculation itself
    named = " and ".join(f"{r['label']}'s [{r['interval'][0]}, {r['interval'][1]}]" for r in others)
    why = f"{best['label']}: {score(best)} tok/s [{low}, {best['interval'][1]}] does not clear {named} by {margin:.0%}"
    return {**out, "verdict": NO_DIFFERENCE, "why": why}


def profile_var(name: str) -> str:
    return TUNED_PREFIX + name


# Where the winner's file goes, under the inventory's directory: group_vars of the group every playbook runs on.
PROFILE_DIR = "group_vars/sglang_nodes"


def profile_file_name(name: str) -> str:
    return f"tuned_{name}.yml"


def default_name(start: str, sweep: str) -> str:
    """<start>_tuned_<sweep>, as a variable's name can hold it."""
    return re.sub(r"[^a-z0-9_]", "_", start.lower()) + "_tuned_" + sweep[:6]


def single_stream(best: dict) -> float | None:
    """The winner's tok/s at concurrency 1, the figure verify's own measure is comparable with; None without."""
    level = next((lv for lv in (best.get("bench") or {}).get("levels") or [] if lv.get("concurrency") == 1), None)
    return level.get("output_tokens_per_s") if level else None


def profile_file(name: str, profile: dict, best: dict, base: dict | None, how: str) -> str:
    """A group_vars file defining profile `name`: the winner's flags and env, its concurrency-1 figure as the
    baseline verify compares with (none when the sweep measured no concurrency 1), and a comment of how it was
    measured. YAML, deterministic."""
    one = single_stream(best)
    doc = {
        profile_var(name): {
            "description": profile.get("description", ""),
            **({"baseline": {"output_tokens_per_s": one}} if one is not None else {}),
            "flags": profile.get("flags") or {},
            **({"env": profile["env"]} if profile.get("env") else {}),
        }
    }
    lines = [
        "---",
        f"# Profile {name!r}, written by `python -m driver tune` (issue 15). Select it with",
        f"#   sglang_profile: {name}     (or profile: {name} on an instance)",
        f"# How it was measured: {how}",
        f"# Its figure: {score(best)} output tok/s, accept length {best.get('accept_length')}"
        + (f"; no speculation in the same sweep: {score(base)} tok/s." if base else "."),
        "# baseline: its tok/s at concurrency 1 (verify measures single requests)"
        if one is not None
        else "# No baseline: the sweep measured no concurrency 1, which verify's single requests compare with.",
    ]
    return "\n".join(lines) + "\n" + _yaml(doc, 0) + "\n"


def _scalar(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a JSON string is a YAML double-quoted scalar ("{{ var }}" stays a template)


def _yaml(doc: dict, indent: int) -> str:
    pad = "  " * indent
    lines = []
    for k, v in doc.items():
        if isinstance(v, dict):
            lines.append(f"{pad}{k}:" + (" {}" if not v else ""))
            if v:
                lines.append(_yaml(v, indent + 1))
        elif isinstance(v, (list, tuple)):
            lines.append(f"{pad}{k}: [{', '.join(_scalar(x) for x in v)}]")
        else:
            lines.append(f"{pad}{k}: {_scalar(v)}")
    return "\n".join(lines)


def esc(text) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def frame(w: int, h: int, m: int, title: str) -> list[str]:
    """A plot's opening: the SVG element, a white ground, the title, the two axes (margin m)."""
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="13">{esc(title)}</text>',
        f'<line x1="{m}" y1="{h - m}" x2="{w - m}" y2="{h - m}" stroke="black"/>',
        f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h - m}" stroke="black"/>',
    ]


def svg(ranked: list[dict], title: str) -> str:
    """tok/s (y) against accept length (x) per measured combination, the baseline as a dashed line."""
    pts = [r for r in ranked if score(r) is not None and r["name"] != BASELINE]
    base = next((r for r in ranked if r["name"] == BASELINE and score(r) is not None), None)
    w, h, m = 640, 400, 60
    xs = [r.get("accept_length") or 1.0 for r in pts] + [1.0]
    ys = [(r.get("interval") or (0, score(r)))[1] for r in pts] + [
        (base.get("interval") or (0, score(base)))[1] if base else 0.0
    ]
    ys = [y for y in ys if y is not None] + [0.0]
    x0, x1 = min(xs) - 0.2, max(xs) + 0.2
    y1 = max(ys) * 1.15 or 1.0

    def px(x: float) -> float:
        return round(m + (x - x0) / (x1 - x0) * (w - 2 * m), 1)

    def py(y: float) -> float:
        return round(h - m - y / y1 * (h - 2 * m), 1)

    out = [
        *frame(w, h, m, title),
        f'<text x="{w / 2}" y="{h - 20}" text-anchor="middle">accept length</text>',
        f'<text x="15" y="{h / 2}" transform="rotate(-90 15 {h / 2})" text-anchor="middle">output tok/s</text>',
    ]
    for t in range(5):
        yv = y1 * t / 4
        out.append(f'<text x="{m - 5}" y="{py(yv) + 4}" text-anchor="end">{yv:.0f}</text>')
        xv = x0 + (x1 - x0) * t / 4
        out.append(f'<text x="{px(xv)}" y="{h - m + 15}" text-anchor="middle">{xv:.2f}</text>')
    if base:
        yb = py(score(base))
        out.append(f'<line x1="{m}" y1="{yb}" x2="{w - m}" y2="{yb}" stroke="gray" stroke-dasharray="6 4"/>')
        if base.get("interval"):  # no speculation's interval, a band
            top, bottom = py(base["interval"][1]), py(max(base["interval"][0], 0.0))
            out.append(
                f'<rect x="{m}" y="{top}" width="{w - 2 * m}" height="{round(bottom - top, 1)}" fill="gray" '
                'fill-opacity="0.15" class="interval"/>'
            )
        out.append(f'<text x="{w - m}" y="{yb - 5}" text-anchor="end" fill="gray">no speculation {score(base)}</text>')
    for r in pts:
        color = "crimson" if r["slower_than_baseline"] else ("forestgreen" if r.get("rank") == 1 else "steelblue")
        x, y = px(r.get("accept_length") or 1.0), py(score(r))
        if r.get("interval"):  # the repeats' 95 % interval, a whisker
            lo, hi = r["interval"]
            out.append(
                f'<line x1="{x}" y1="{py(max(lo, 0.0))}" x2="{x}" y2="{py(hi)}" stroke="{color}" class="interval"/>'
            )
        out.append(
            f'<circle cx="{x}" cy="{y}" r="5" fill="{color}"><title>{esc(r.get("label", r["name"]))}</title></circle>'
        )
        out.append(f'<text x="{x + 7}" y="{y - 6}">{esc(r.get("label", r["name"]))}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def concurrency_svg(ranked: list[dict]) -> str | None:
    """tok/s (y) against the concurrency levels (x, evenly spaced) per measured combination, a line each, with
    each level's interval as a whisker: where speculation's gain shrinks or turns. None with one level only."""
    lines = {
        r.get("label", r["name"]): [(lv["concurrency"], lv.get("output_tokens_per_s"), lv.get("interval"))
                                    for lv in (r.get("bench") or {}).get("levels") or []]
        for r in ranked
        if score(r) is not None
    }  # fmt: skip
    levels = sorted({c for pts in lines.values() for c, v, _ in pts if v is not None})
    if len(levels) < 2:
        return None
    w, h, m = 640, 400, 60
    top = max((iv or (0, v))[1] for pts in lines.values() for _, v, iv in pts if v is not None) * 1.15 or 1.0

    def px(c: int) -> float:
        return round(m + levels.index(c) / (len(levels) - 1) * (w - 2 * m), 1)

    def py(y: float) -> float:
        return round(h - m - max(y, 0.0) / top * (h - 2 * m), 1)

    out = [
        *frame(w, h, m, "output tok/s by concurrency"),
        *(f'<text x="{px(c)}" y="{h - m + 15}" text-anchor="middle">{c}</text>' for c in levels),
        f'<text x="{w / 2}" y="{h - 20}" text-anchor="middle">concurrency</text>',
    ]
    for label, pts in lines.items():
        known = [(c, v, iv) for c, v, iv in pts if v is not None]
        color = "gray" if label == "no speculation" else "steelblue"
        path = " ".join(f"{px(c)},{py(v)}" for c, v, _ in known)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}"><title>{esc(label)}</title></polyline>')
        for c, _, iv in known:
            if iv:
                out.append(
                    f'<line x1="{px(c)}" y1="{py(iv[0])}" x2="{px(c)}" y2="{py(iv[1])}" stroke="{color}" class="interval"/>'
                )
        c, v, _ = known[-1]
        out.append(f'<text x="{px(c) + 4}" y="{py(v)}" fill="{color}">{esc(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
