r"""Module-name patterns for ignored_layers (one parser, used by the config, the passes and prepare_model).

Rules, checked in this order for each pattern:
  1. "re:<regex>"  - the regular expression must match the whole module name.
  2. a glob (contains *, ? or [) - fnmatch against the whole name.
  3. a plain name  - matches any run of whole dotted components:
     "img_mlp" matches "transformer_blocks.7.img_mlp.net.0.proj",
     "attn.to_q" matches "blocks.0.attn.to_q", but "mlp" does not match "img_mlp".
  4. "preset:<name>" - a named set of patterns (PRESETS), e.g. "preset:vllm-omni-flux".
A module is ignored if any pattern matches it (patterns never cancel each other).

No regular expression can stall a compile. Python's `re` backtracks: "(a+)+", "(a|a)*",
"(.*.*)*z" or ".*.*.*.*.*.*.*z" take exponential or high-polynomial time to fail on a name
(minutes to years for one module name). A pattern of such a shape (_backtracking_hazard: a
repeated group holding a variable-length repeat, a repeated alternation whose branches can start
alike, more than MAX_BACKTRACKING_REPEATS variable-length repeats) runs on a Thompson automaton
(_Automaton: each character is read once, for all states at once) holding the regular
constructs: literals, classes, ".", groups, alternation, repeats, ^ $ \A \Z \b \B, the s / a
flags. Any other pattern runs on Python's re, fast on its shape. A pattern of such a shape that
needs backtracking (backreferences, lookaround, atomic groups, possessive repeats, other inline
flags) is refused when the config is validated, naming it.
"""
from __future__ import annotations

import fnmatch
import functools
import re
import re._constants as _sre
import re._parser as _sre_parse
from typing import Iterable, Optional

#: named sets of ignored_layers patterns ("preset:<name>")
PRESETS: dict[str, tuple[str, ...]] = {
    # vLLM-Omni keeps every FLUX dual-stream block in BF16 (FP8 on the joint-attention path was
    # visibly noisy on FLUX.1 with per-tensor weight scales); fx_fp8 quantizes them by default
    "vllm-omni-flux": ("re:transformer_blocks\\..*",),
}
PRESET_PREFIX = "preset:"


def validate_pattern(pattern: str) -> None:
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError(f"invalid ignored_layers pattern {pattern!r}: empty")
    if pattern.startswith(PRESET_PREFIX):
        if pattern[len(PRESET_PREFIX):] not in PRESETS:
            raise ValueError(f"unknown ignored_layers preset {pattern!r}: expected one of "
                             f"{', '.join(PRESET_PREFIX + k for k in PRESETS)}")
        return
    if pattern.startswith("re:"):
        try:
            parsed = _sre_parse.parse(pattern[3:])
            re.compile(pattern[3:])
        except re.error as e:
            raise ValueError(f"invalid ignored_layers pattern {pattern!r}: bad regular expression ({e})") from None
        why = _backtracking_hazard(list(parsed))
        if why is not None and _Automaton.build(parsed) is None:  # only Python's re can match it: refuse
            raise ValueError(
                f"invalid ignored_layers pattern {pattern!r}: {why}, and it uses a construct only Python's "
                "backtracking re matches (backreference, lookaround, atomic group, possessive repeat or an inline "
                "flag other than s / a), which can then take exponential time to fail to match a module name; "
                "write it without the nesting or the overlapping branches, or without the backtracking construct "
                "(any shape is then matched in linear time)")


_REPEATS = tuple(op for op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", None))
                 if op is not None)
#: a pattern Python's re matches may hold at most this many repeats of variable length: each one
#: more multiplies the work to fail on a name by its length (".*.*.*.*.*.*.*z" is ~n^7 steps)
MAX_BACKTRACKING_REPEATS = 3


def _children(op, av) -> list:
    """The sub-patterns of one parsed item."""
    if op in _REPEATS:
        return [av[2]]
    if op is _sre.SUBPATTERN:
        return [av[-1]]
    if op is _sre.BRANCH:
        return list(av[1])
    if op in (_sre.ASSERT, _sre.ASSERT_NOT):
        return [av[1]]
    if op is getattr(_sre, "ATOMIC_GROUP", None):
        return [av]
    if op is _sre.GROUPREF_EXISTS:
        return [b for b in av[1:] if b is not None]
    return []


def _first_chars(items) -> Optional[set]:
    """The characters a sub-pattern's match can start with (a set of literal code points), or
    None when it is not a short list of literals (a class, '.', an optional start)."""
    for op, av in items:
        if op is _sre.LITERAL:
            return {av}
        if op is _sre.SUBPATTERN:
            return _first_chars(av[-1])
        if op is _sre.BRANCH:
            sets = [_first_chars(b) for b in av[1]]
            return None if any(x is None for x in sets) else set().union(*sets)
        if op is _sre.IN and all(o is _sre.LITERAL for o, _ in av):
            return {a for _, a in av}
        if op in _REPEATS and av[0] >= 1:
            return _first_chars(av[2])
        if op is _sre.AT:
            continue
        return None
    return None


def _backtracking_hazard(items) -> Optional[str]:
    """Why backtracking may take exponential (or high-polynomial) time on this parsed pattern,
    or None: a repeated group holding a repeat of variable length ('(a+)+', '(.*.*)*',
    '(a{1,9}){1,9}'), a repeated alternation whose branches can start with the same character
    ('(a|a)*', '(a|ab)+'; a branch starting with a class or '.' counts as starting like any
    other), or more than MAX_BACKTRACKING_REPEATS repeats of unbounded or ranged length."""
    variable = 0

    def walk(items, inside_repeat: bool) -> Optional[str]:
        nonlocal variable
        for op, av in items:
            repeat = op in _REPEATS
            if repeat:
                lo, hi, body = av
                if hi - lo > 1:  # '?' only doubles the work; '*', '+', '{1,4}' multiply it by the length
                    variable += 1
                if inside_repeat and hi != lo:
                    return "a repeated group holds a repeat of variable length (as in '(a+)*' or '(.*.*)*')"
            if op is _sre.BRANCH and inside_repeat:
                seen: set = set()
                for branch in av[1]:
                    first = _first_chars(branch)
                    if first is None or first & seen:
                        return "a repeated alternation has branches that can start alike (as in '(a|a)*')"
                    seen |= first
            for child in _children(op, av):
                why = walk(child, inside_repeat or (repeat and av[1] > 1))
                if why is not None:
                    return why
        return None

    why = walk(items, False)
    if why is None and variable > MAX_BACKTRACKING_REPEATS:
        why = f"it holds {variable} repeats of variable length (more than {MAX_BACKTRACKING_REPEATS})"
    return why


class _Automaton:
    """A Thompson automaton for the regular part of Python's regex syntax: fullmatch in time
    O(len(name) x states), never backtracking. build() returns None for what it cannot express
    (backreferences, lookaround, atomic groups, possessive repeats, inline flags other than
    s / a, an expansion past MAX_STATES), which Python's re then matches."""

    MAX_STATES = 20000
    MAX_CACHED_STEPS = 50000
    _CHAR, _SPLIT, _JMP, _AT, _MATCH = range(5)

    def __init__(self, flags: int):
        self.prog: list = []  # (kind, arg, arg2)
        self.dotall = bool(flags & _sre.SRE_FLAG_DOTALL)
        self.ascii = bool(flags & _sre.SRE_FLAG_ASCII)
        self.positional = False  # holds ^, $, \b...: a step depends on the position
        self.sets: list = []  # state set number -> the set (a tuple of states)
        self.ids: dict = {}  # the set -> its number
        self.accepting: list = []  # state set number -> does it hold the match state
        self.steps: dict = {}  # (state set number, character) -> next number; -1: no state left
        self.start = -1

    @classmethod
    def build(cls, parsed) -> Optional["_Automaton"]:
        flags = parsed.state.flags & ~(_sre.SRE_FLAG_UNICODE | _sre.SRE_FLAG_VERBOSE)
        if flags & ~(_sre.SRE_FLAG_DOTALL | _sre.SRE_FLAG_ASCII):
            return None
        auto = cls(parsed.state.flags)
        try:
            auto._emit(list(parsed))
        except _Unsupported:
            return None
        auto.prog.append((cls._MATCH, None, None))
        auto.positional = any(kind == cls._AT for kind, _, _ in auto.prog)
        auto.start = -1 if auto.positional else auto._number(tuple(auto._closure([0], "", 0)))
        return auto

    # -- compiling ------------------------------------------------------------------------------
    def _add(self, kind, arg=None, arg2=None) -> int:
        if len(self.prog) >= self.MAX_STATES:
            raise _Unsupported
        self.prog.append((kind, arg, arg2))
        return len(self.prog) - 1

    def _emit(self, items) -> None:
        for op, av in items:
            if op in (_sre.LITERAL, _sre.NOT_LITERAL, _sre.ANY, _sre.IN):
                self._add(self._CHAR, self._char_test(op, av))
            elif op is _sre.AT:
                if av not in (_sre.AT_BEGINNING, _sre.AT_BEGINNING_STRING, _sre.AT_END, _sre.AT_END_STRING,
                              _sre.AT_BOUNDARY, _sre.AT_NON_BOUNDARY):
                    raise _Unsupported
                self._add(self._AT, av)
            elif op is _sre.SUBPATTERN:
                if av[1] or av[2]:  # scoped flags (?i:...)
                    raise _Unsupported
                self._emit(av[-1])
            elif op is _sre.BRANCH:
                self._branch(av[1])
            elif op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT):  # greedy or lazy: the same set of full matches
                self._repeat(*av)
            else:
                raise _Unsupported

    def _branch(self, branches) -> None:
        jumps = []
        for i, branch in enumerate(branches):
            if i < len(branches) - 1:
                split = self._add(self._SPLIT)
                self._emit(branch)
                jumps.append(self._add(self._JMP))
                self.prog[split] = (self._SPLIT, split + 1, len(self.prog))
            else:
                self._emit(branch)
        for j in jumps:
            self.prog[j] = (self._JMP, len(self.prog), None)

    def _repeat(self, lo: int, hi, body) -> None:
        for _ in range(lo):
            self._emit(body)
        if hi == _sre.MAXREPEAT:
            split = self._add(self._SPLIT)
            self._emit(body)
            self._add(self._JMP, split)
            self.prog[split] = (self._SPLIT, split + 1, len(self.prog))
            return
        splits = []
        for _ in range(hi - lo):
            splits.append(self._add(self._SPLIT))
            self._emit(body)
        for sp in splits:
            self.prog[sp] = (self._SPLIT, sp + 1, len(self.prog))

    def _is_word(self, c: str) -> bool:
        return (c.isascii() and (c.isalnum() or c == "_")) if self.ascii else (c.isalnum() or c == "_")

    def _category(self, cat):
        ascii_ = self.ascii
        tests = {
            _sre.CATEGORY_DIGIT: (lambda c: c.isascii() and c.isdigit()) if ascii_ else str.isdecimal,
            _sre.CATEGORY_SPACE: (lambda c: c in " \t\n\r\f\v") if ascii_ else str.isspace,
            _sre.CATEGORY_WORD: self._is_word,
        }
        negated = {_sre.CATEGORY_NOT_DIGIT: _sre.CATEGORY_DIGIT, _sre.CATEGORY_NOT_SPACE: _sre.CATEGORY_SPACE,
                   _sre.CATEGORY_NOT_WORD: _sre.CATEGORY_WORD}
        if cat in tests:
            return tests[cat]
        if cat in negated:
            test = tests[negated[cat]]
            return lambda c: not test(c)
        raise _Unsupported

    def _char_test(self, op, av):
        if op is _sre.LITERAL:
            ch = chr(av)
            return lambda c: c == ch
        if op is _sre.NOT_LITERAL:
            ch = chr(av)
            return lambda c: c != ch
        if op is _sre.ANY:
            return (lambda c: True) if self.dotall else (lambda c: c != "\n")
        negate, tests = False, []
        for iop, iav in av:
            if iop is _sre.NEGATE:
                negate = True
            elif iop is _sre.LITERAL:
                tests.append(lambda c, ch=chr(iav): c == ch)
            elif iop is _sre.RANGE:
                tests.append(lambda c, lo=iav[0], hi=iav[1]: lo <= ord(c) <= hi)
            elif iop is _sre.CATEGORY:
                tests.append(self._category(iav))
            else:
                raise _Unsupported
        return lambda c: any(t(c) for t in tests) != negate

    # -- matching -------------------------------------------------------------------------------
    def _at(self, kind, name: str, i: int) -> bool:
        n = len(name)
        if kind in (_sre.AT_BEGINNING, _sre.AT_BEGINNING_STRING):
            return i == 0
        if kind == _sre.AT_END_STRING:
            return i == n
        if kind == _sre.AT_END:  # '$': the end, or before a final newline
            return i == n or (i == n - 1 and name[i] == "\n")
        before = i > 0 and self._is_word(name[i - 1])
        after = i < n and self._is_word(name[i])
        return (before != after) == (kind == _sre.AT_BOUNDARY)

    def _closure(self, starts, name: str, i: int) -> list:
        """The character-reading (and match) states reachable from `starts` without reading."""
        prog, out, seen, stack = self.prog, [], set(), list(reversed(starts))
        while stack:
            pc = stack.pop()
            if pc in seen:
                continue
            seen.add(pc)
            kind, a, b = prog[pc]
            if kind == self._JMP:
                stack.append(a)
            elif kind == self._SPLIT:
                stack.extend((b, a))
            elif kind == self._AT:
                if self._at(a, name, i):
                    stack.append(pc + 1)
            else:
                out.append(pc)
        return out

    def fullmatch(self, name: str) -> bool:
        """Does the automaton match all of `name`? Each character moves the set of live states at
        once. Without position assertions each state set gets a number and the step from a set on
        a character is cached (a lazy DFA, bounded by MAX_CACHED_STEPS): a name then costs one
        dict lookup per character."""
        if self.positional:
            states = self._closure([0], name, 0)
            for i, c in enumerate(name):
                states = self._closure(self._move(states, c), name, i + 1)
                if not states:
                    return False
            return self._accepts(states)
        steps, sid = self.steps, self.start
        for c in name:
            nxt = steps.get((sid, c))
            if nxt is None:
                moved = self._move(self.sets[sid], c)
                nxt = self._number(tuple(self._closure(moved, name, 0))) if moved else -1
                if len(steps) >= self.MAX_CACHED_STEPS:
                    steps.clear()
                steps[(sid, c)] = nxt
            if nxt < 0:
                return False
            sid = nxt
        return self.accepting[sid]

    def _move(self, states, c: str) -> list:
        prog, char = self.prog, self._CHAR
        return [pc + 1 for pc in states if prog[pc][0] == char and prog[pc][1](c)]

    def _accepts(self, states) -> bool:
        return any(self.prog[pc][0] == self._MATCH for pc in states)

    def _number(self, states: tuple) -> int:
        sid = self.ids.get(states)
        if sid is None:
            sid = self.ids[states] = len(self.sets)
            self.sets.append(states)
            self.accepting.append(self._accepts(states))
        return sid


class _Unsupported(Exception):
    pass


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str):
    if pattern.startswith(PRESET_PREFIX):
        members = [_compiled(p) for p in PRESETS[pattern[len(PRESET_PREFIX):]]]
        return lambda name: any(m(name) for m in members)
    if pattern.startswith("re:"):
        parsed = _sre_parse.parse(pattern[3:])
        auto = _Automaton.build(parsed) if _backtracking_hazard(list(parsed)) is not None else None
        if auto is not None:  # a shape that backtracks badly: the automaton
            return auto.fullmatch
        rx = re.compile(pattern[3:])  # fast on this shape (validate_pattern refused the others)
        return lambda name: rx.fullmatch(name) is not None
    if any(c in pattern for c in "*?["):
        return lambda name: fnmatch.fnmatchcase(name, pattern)
    want = pattern.strip(".").split(".")
    n = len(want)

    def plain(name: str) -> bool:
        parts = name.split(".")
        return any(parts[i : i + n] == want for i in range(len(parts) - n + 1))

    return plain


def matches(pattern: str, name: str) -> bool:
    return _compiled(pattern)(name)


def first_match(patterns: Iterable[str], name: str) -> Optional[str]:
    """The first of `patterns` that matches `name`, or None. Remembered per (patterns, name): every
    block instance of a regional compile asks the same questions about its layers."""
    return _first_match(patterns if isinstance(patterns, tuple) else tuple(patterns), name)


@functools.lru_cache(maxsize=1 << 16)
def _first_match(patterns: tuple, name: str) -> Optional[str]:
    for p in patterns:
        if matches(p, name):
            return p
    return None
