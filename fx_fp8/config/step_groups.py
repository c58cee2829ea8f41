"""Groups of denoising steps that share a per-step activation scale: parsed from "0-4,5-9",
checked (sorted, no overlap), formatted back, and cut from the steps a calibration saw
(fx_fp8.calibrate(..., per_step=True, step_groups=...))."""

from __future__ import annotations

from fx_fp8.config.selectors import parse_selector
from fx_fp8.config.values import short_repr


def parse_step_groups(value, what: str = "step_groups") -> tuple[tuple[int, int], ...]:
    """ "0-4,5-9" / ["0-4", "5-9"] / [(0, 4), (5, 9)] -> ((0, 4), (5, 9)): each comma-separated
    step or inclusive range is one group; groups must not overlap."""
    if isinstance(value, str):
        tokens = [t for t in value.split(",")]
        if not value.strip():
            raise ValueError(f"invalid {what} {short_repr(value)}: expected groups like '0-4,5-9'")
    elif isinstance(value, (list, tuple)) and value:
        tokens = list(value)
    else:
        raise ValueError(
            f"invalid {what} {short_repr(value)}: expected an int (number of groups) or groups like '0-4,5-9'"
        )
    groups = []
    for token in tokens:
        if isinstance(token, (list, tuple)) and len(token) == 2:
            lo, hi = token
        elif isinstance(token, int) and not isinstance(token, bool):
            lo = hi = token
        elif isinstance(token, str):
            sel = parse_selector(token, what=what)
            if len(sel.ranges) != 1:
                raise ValueError(
                    f"invalid group {short_repr(token)} in {what} {short_repr(value)}: expected one step or range 'a-b'"
                )
            ((lo, hi),) = sel.ranges
        else:
            raise ValueError(
                f"invalid group {short_repr(token)} in {what} {short_repr(value)}: expected a step or a range 'a-b'"
            )
        groups.append((lo, hi))
    return check_step_groups(groups, f"{what} {short_repr(value)}")


def check_step_groups(groups, where: str) -> tuple[tuple[int, int], ...]:
    """Groups as sorted (first, last) inclusive ranges of steps >= 0 that do not overlap."""
    out = []
    for g in groups:
        if (
            not isinstance(g, (list, tuple))
            or len(g) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in g)
            or g[1] < g[0]
        ):
            raise ValueError(
                f"invalid step group {short_repr(g)} in {where}: expected [first, last] steps, 0 <= first <= last"
            )
        out.append((int(g[0]), int(g[1])))
    if not out:
        raise ValueError(f"no step groups in {where}")
    out.sort()
    for (lo0, hi0), (lo1, hi1) in zip(out, out[1:]):
        if lo1 <= hi0:
            raise ValueError(f"step groups {lo0}-{hi0} and {lo1}-{hi1} overlap in {where}")
    return tuple(out)


def format_step_groups(groups) -> str:
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in groups)


def group_steps(seen: list[int], step_groups) -> tuple[tuple[int, int], ...]:
    """The step groups of a calibration that saw the (sorted) steps `seen`: one group per step
    (None), n contiguous groups of near-equal length (an int), or the groups given; every step
    seen must be in a group and every group must hold a step seen."""
    if step_groups is None:
        return tuple((s, s) for s in seen)
    if isinstance(step_groups, int) and not isinstance(step_groups, bool):
        span = seen[-1] - seen[0] + 1
        if not 1 <= step_groups <= span:
            raise ValueError(
                f"invalid step_groups {step_groups}: the calibration saw steps "
                f"{format_step_groups(_runs(seen))}, so between 1 and {span} groups"
            )
        bounds = [seen[0] + (span * i) // step_groups for i in range(step_groups + 1)]
        groups = tuple((bounds[i], bounds[i + 1] - 1) for i in range(step_groups))
    else:
        groups = parse_step_groups(step_groups)
    outside = [s for s in seen if not any(lo <= s <= hi for lo, hi in groups)]
    if outside:
        raise ValueError(
            f"step_groups {short_repr(step_groups)}: the calibration ran step(s) "
            f"{format_step_groups(_runs(outside))} that are in no group"
        )
    empty = [(lo, hi) for lo, hi in groups if not any(lo <= s <= hi for s in seen)]
    if empty:
        raise ValueError(
            f"step_groups {short_repr(step_groups)}: the calibration ran no step of group(s) "
            f"{format_step_groups(empty)} (it saw steps {format_step_groups(_runs(seen))})"
        )
    return groups


def _runs(steps: list[int]) -> list[tuple[int, int]]:
    """[0, 1, 2, 5] -> [(0, 2), (5, 5)]."""
    out: list[list[int]] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return [(lo, hi) for lo, hi in out]
