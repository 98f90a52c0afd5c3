"""Teach a Megatron-LM checkout's ``pretrain_gpt.py`` the ``--flat-*`` flags.

    python -m megatron_flat patch <Megatron-LM dir> [--revert] [--check] [--dry-run]
    python patches/apply.py <Megatron-LM dir> [...]     # the same, from a source checkout

Part of the package, so an installed megatron-flat (a wheel has no ``patches/``) can patch a
checkout too; ``patches/apply.py`` is the entry the README shows and calls this module.

Edits by anchors, never by copying Megatron-LM source: the file is parsed with ``ast``, the
``if __name__ == "__main__":`` block and the ``pretrain(...)`` / ``parse_and_validate_args(...)``
calls in it are located by name, and small text edits are made at those positions:

* 0.16-era (``pretrain(..., extra_args_provider=X)`` parses the arguments): ``X`` becomes
  ``flat_extra_args(X)`` and the model provider ``M`` (2nd positional argument) becomes
  ``flat_model_provider(M)``, which runs ``flat_install(get_args())`` before the first build.
* 0.19-era (``args = parse_and_validate_args(extra_args_provider=X, ...)`` then
  ``pretrain(full_config, ...)``): ``X`` becomes ``flat_extra_args(X)`` and
  ``flat_install(args)`` is inserted right after that statement.
* Both: one import line from ``megatron_flat.megatron.entry`` after the last top-level import.
  A call without ``extra_args_provider=`` gets ``extra_args_provider=flat_extra_args()``.

Every line inserted or changed ends with ``  # megatron-flat``. ``--revert`` undoes the edits
by their inverse (unwrap, delete the inserted lines, strip the markers), and an apply is
written only after checking that reverting its result gives the original bytes back.

Exit status: 0 done (also: already patched / nothing to revert; ``--check``: patched),
1 ``--check``: not patched, 2 refused (anchors missing or ambiguous, file not Python, a
partial patch); a refused file is never written.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import io
import os
import sys
import tempfile
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

TARGET = "pretrain_gpt.py"
MARKER = "# megatron-flat"
SUFFIX = b"  " + MARKER.encode()
ENTRY_MODULE = "megatron_flat.megatron.entry"
EXTRA_ARGS_KEYWORD = "extra_args_provider"
WRAP_EXTRA_ARGS = "flat_extra_args"
WRAP_MODEL_PROVIDER = "flat_model_provider"
INSTALL = "flat_install"
# Where extra_args_provider sits when passed positionally (0-based):
# 0.16 pretrain(datasets_provider, model_provider, model_type, forward_step_func,
#               process_non_loss_data_func, extra_args_provider, ...)
# 0.19 parse_and_validate_args(extra_args_provider, ignore_unknown_args, args_defaults)
PRETRAIN_EXTRA_ARGS_POSITION = 5
PARSE_EXTRA_ARGS_POSITION = 0

# Insertions at the same offset go in this order: text closing the previous token, the
# end-of-line marker, a whole new line, text opening the next token.
CLOSE, MARK, LINE, OPEN = range(4)

EXIT_OK, EXIT_UNPATCHED, EXIT_REFUSED = 0, 1, 2


class PatchError(Exception):
    """An anchor is missing or ambiguous, or the file is in a state we cannot edit exactly."""


# ---------------------------------------------------------------------------- source text
class Source:
    """UTF-8 bytes of a Python file with its ``ast`` and byte offsets of each line.

    ``ast`` column offsets count UTF-8 bytes, so all edits are made on bytes.
    """

    def __init__(self, data: bytes, name: str = TARGET):
        self.data = data
        self.name = name
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PatchError(f"{name} is not UTF-8 ({exc})") from None
        try:
            self.tree = ast.parse(data, filename=name)
        except SyntaxError as exc:
            raise PatchError(f"{name} does not parse as Python (line {exc.lineno}: {exc.msg})")
        self.lines = data.splitlines(keepends=True)  # bytes: splits on \n, \r\n, \r only
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        return self.starts[lineno - 1] + col

    def span(self, node: ast.AST) -> Tuple[int, int]:
        return (self.offset(node.lineno, node.col_offset),
                self.offset(node.end_lineno, node.end_col_offset))

    def content(self, lineno: int) -> bytes:
        """Line ``lineno`` without its line ending."""
        return self.lines[lineno - 1].rstrip(b"\r\n")

    def line_end(self, lineno: int) -> int:
        """Offset of line ``lineno``'s line ending (or of the end of file)."""
        return self.starts[lineno - 1] + len(self.content(lineno))

    def newline(self, lineno: int) -> bytes:
        return self.lines[lineno - 1][len(self.content(lineno)):]

    def text(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.data[start:end].decode()

    def comment_lines(self) -> Dict[int, str]:
        """Line number -> text of the comment token on that line."""
        found = {}
        for tok in tokenize.tokenize(io.BytesIO(self.data).readline):
            if tok.type == tokenize.COMMENT:
                found[tok.start[0]] = tok.string
        return found


def callee(call: ast.Call) -> Optional[str]:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def calls_named(root: ast.AST, name: str) -> List[ast.Call]:
    found = [n for n in ast.walk(root) if isinstance(n, ast.Call) and callee(n) == name]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def lines_of(nodes: Sequence[ast.AST]) -> str:
    return ", ".join(str(n.lineno) for n in nodes)


# ---------------------------------------------------------------------------- anchors
def is_main_guard(node: ast.stmt) -> bool:
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
        return False
    test = node.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


def main_block(src: Source) -> ast.If:
    blocks = [n for n in src.tree.body if is_main_guard(n)]
    if not blocks:
        raise PatchError(f'{src.name}: no top-level `if __name__ == "__main__":` block')
    if len(blocks) > 1:
        raise PatchError(f'{src.name}: {len(blocks)} `if __name__ == "__main__":` blocks '
                         f"(lines {lines_of(blocks)}); expected exactly one")
    return blocks[0]


def statement_holding(root: ast.AST, call: ast.Call) -> Optional[ast.stmt]:
    """The ``name = call`` (or ``name: T = call``) statement whose value is ``call``."""
    for node in ast.walk(root):
        if isinstance(node, ast.Assign) and node.value is call:
            if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                return node
        if isinstance(node, ast.AnnAssign) and node.value is call:
            if isinstance(node.target, ast.Name):
                return node
    return None


@dataclass(frozen=True)
class Generation:
    """One call shape of ``pretrain_gpt.py``'s ``__main__`` block and how to patch it."""

    name: str
    shape: str
    imports: Tuple[str, ...]
    plan: Callable[["Anchors", "Patch"], None]


@dataclass
class Anchors:
    src: Source
    generation: Generation
    main: ast.If
    pretrain: ast.Call
    parse: Optional[ast.Call] = None
    parse_stmt: Optional[ast.stmt] = None


def find_anchors(src: Source) -> Anchors:
    """Locate the anchors in an unpatched file and decide its generation, or refuse."""
    main = main_block(src)
    pretrains = calls_named(main, "pretrain")
    if not pretrains:
        raise PatchError(f"{src.name}: no pretrain(...) call in the __main__ block "
                         f"(line {main.lineno})")
    if len(pretrains) > 1:
        raise PatchError(f"{src.name}: {len(pretrains)} pretrain(...) calls in the __main__ "
                         f"block (lines {lines_of(pretrains)}); expected exactly one")
    pretrain = pretrains[0]
    parses = calls_named(main, "parse_and_validate_args")
    if len(parses) > 1:
        raise PatchError(f"{src.name}: {len(parses)} parse_and_validate_args(...) calls in the "
                         f"__main__ block (lines {lines_of(parses)}); expected at most one")
    if not parses:
        imported = any(isinstance(n, ast.alias) and (n.asname or n.name) ==
                       "parse_and_validate_args" for n in ast.walk(src.tree))
        if imported:
            raise PatchError(f"{src.name}: parse_and_validate_args is imported but not called "
                             "in the __main__ block; cannot tell the generation")
        return Anchors(src, GEN_016, main, pretrain)
    parse = parses[0]
    stmt = statement_holding(main, parse)
    if stmt is None:
        raise PatchError(f"{src.name}: parse_and_validate_args(...) at line {parse.lineno} is "
                         "not assigned as `args = parse_and_validate_args(...)`")
    if (parse.lineno, parse.col_offset) > (pretrain.lineno, pretrain.col_offset):
        raise PatchError(f"{src.name}: parse_and_validate_args(...) at line {parse.lineno} "
                         f"comes after pretrain(...) at line {pretrain.lineno}")
    return Anchors(src, GEN_019, main, pretrain, parse, stmt)


# ---------------------------------------------------------------------------- edits
@dataclass
class Patch:
    """Insertions into ``src`` plus the lines that get the trailing marker."""

    src: Source
    inserts: List[Tuple[int, int, bytes]] = field(default_factory=list)  # (offset, rank, text)
    marked: set = field(default_factory=set)
    notes: List[Tuple[int, str]] = field(default_factory=list)  # (line, what)

    def _check_markable(self, lineno: int) -> None:
        if self.src.content(lineno).rstrip().endswith(b"\\"):
            raise PatchError(f"{self.src.name}: line {lineno} ends with a backslash "
                             "continuation; cannot mark it")

    def mark(self, lineno: int) -> None:
        self._check_markable(lineno)
        self.marked.add(lineno)

    def wrap(self, node: ast.expr, wrapper: str) -> None:
        start, end = self.src.span(node)
        self.inserts += [(start, OPEN, f"{wrapper}(".encode()), (end, CLOSE, b")")]
        self.mark(node.lineno)
        self.mark(node.end_lineno)
        self.notes.append((node.lineno, f"line {node.lineno}: {self.src.text(node)} -> "
                                         f"{wrapper}(...)"))

    def line_after(self, stmt: ast.stmt, text: str, indent: bytes = b"") -> None:
        """Insert ``indent + text + marker`` as a new line after statement ``stmt``."""
        src = self.src
        rest = src.data[src.span(stmt)[1]:src.line_end(stmt.end_lineno)].strip()
        if rest and not rest.startswith(b"#"):
            raise PatchError(f"{src.name}: line {stmt.end_lineno} has more code after the "
                             "statement; cannot insert a line after it")
        newline = src.newline(stmt.end_lineno)
        if not newline:
            raise PatchError(f"{src.name}: line {stmt.end_lineno} is the last line and has "
                             "no line ending")
        self.inserts.append((src.starts[stmt.end_lineno], LINE,
                             indent + text.encode() + SUFFIX + newline))
        self.notes.append((stmt.end_lineno, f"after line {stmt.end_lineno}: + {text}"))

    def extra_args(self, call: ast.Call, what: str, position: int) -> None:
        """Wrap ``call``'s extra_args_provider (keyword, or positional at ``position``), or
        add the keyword."""
        for kw in call.keywords:
            if kw.arg == EXTRA_ARGS_KEYWORD:
                self.wrap(kw.value, WRAP_EXTRA_ARGS)
                return
        if any(isinstance(a, ast.Starred) for a in call.args[:position + 1]):
            raise PatchError(f"{self.src.name}: {what}(...) at line {call.lineno} passes *args; "
                             f"cannot tell where its {EXTRA_ARGS_KEYWORD} is")
        if len(call.args) > position:
            self.wrap(call.args[position], WRAP_EXTRA_ARGS)
            return
        if any(kw.arg is None for kw in call.keywords):
            raise PatchError(f"{self.src.name}: {what}(...) at line {call.lineno} passes "
                             f"**kwargs and no {EXTRA_ARGS_KEYWORD}=; cannot tell whether it "
                             "already carries one")
        added = f"{EXTRA_ARGS_KEYWORD}={WRAP_EXTRA_ARGS}()"
        arguments = list(call.args) + list(call.keywords)
        if arguments:
            last = max(arguments, key=lambda n: (n.end_lineno, n.end_col_offset))
            at, text, lineno = self.src.span(last)[1], ", " + added, last.end_lineno
        else:
            at, lineno = self.src.span(call)[1] - 1, call.end_lineno
            if self.src.data[at:at + 1] != b")":
                raise PatchError(f"{self.src.name}: cannot find the closing parenthesis of "
                                 f"{what}(...) at line {call.lineno}")
            text = added
        self.inserts.append((at, CLOSE, text.encode()))
        self.mark(lineno)
        self.notes.append((lineno, f"line {lineno}: {what}(...) gets {added}"))

    def import_line(self, names: Sequence[str]) -> None:
        imports = [n for n in self.src.tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        if not imports:
            raise PatchError(f"{self.src.name}: no top-level import to place the "
                             f"{ENTRY_MODULE} import after")
        self.line_after(imports[-1], f"from {ENTRY_MODULE} import {', '.join(names)}")

    def result(self) -> bytes:
        inserts = list(self.inserts)
        for lineno in self.marked:
            inserts.append((self.src.line_end(lineno), MARK, SUFFIX))
        out, pos = [], 0
        for at, _, text in sorted(inserts, key=lambda t: (t[0], t[1])):
            out += [self.src.data[pos:at], text]
            pos = at
        out.append(self.src.data[pos:])
        return b"".join(out)


def plan_016(anchors: Anchors, patch: Patch) -> None:
    call = anchors.pretrain
    patch.extra_args(call, "pretrain", PRETRAIN_EXTRA_ARGS_POSITION)
    if len(call.args) >= 2 and not any(isinstance(a, ast.Starred) for a in call.args[:2]):
        patch.wrap(call.args[1], WRAP_MODEL_PROVIDER)
    else:
        given = [kw for kw in call.keywords if kw.arg == "model_provider"]
        if not given:
            raise PatchError(f"{anchors.src.name}: pretrain(...) at line {call.lineno} has no "
                             "model provider (2nd positional argument or model_provider=)")
        patch.wrap(given[0].value, WRAP_MODEL_PROVIDER)
    patch.import_line(GEN_016.imports)


def plan_019(anchors: Anchors, patch: Patch) -> None:
    stmt = anchors.parse_stmt
    src = anchors.src
    patch.extra_args(anchors.parse, "parse_and_validate_args", PARSE_EXTRA_ARGS_POSITION)
    indent = src.content(stmt.lineno)[:stmt.col_offset]
    if indent.strip():
        raise PatchError(f"{src.name}: line {stmt.lineno} has code before "
                         "`args = parse_and_validate_args(...)`; cannot indent after it")
    target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
    patch.line_after(stmt, f"{INSTALL}({target.id})", indent)
    patch.import_line(GEN_019.imports)


GEN_016 = Generation(
    name="0.16",
    shape="pretrain(..., extra_args_provider=...) parses the arguments",
    imports=(WRAP_EXTRA_ARGS, WRAP_MODEL_PROVIDER),
    plan=plan_016,
)
GEN_019 = Generation(
    name="0.19",
    shape="args = parse_and_validate_args(extra_args_provider=...) before pretrain(config, ...)",
    imports=(WRAP_EXTRA_ARGS, INSTALL),
    plan=plan_019,
)
GENERATIONS = (GEN_016, GEN_019)


# ---------------------------------------------------------------------------- patch / revert
def unpatch(data: bytes, name: str = TARGET) -> bytes:
    """Inverse of ``patch``: unwrap, delete the inserted lines, strip the markers.

    Only constructs on marked lines are touched, so a file never patched comes back as is.
    """
    src = Source(data, name)
    comments = src.comment_lines()
    marked = {n for n, c in comments.items()
              if c.endswith(MARKER) and src.content(n).endswith(SUFFIX)}
    if not marked:
        return data
    cuts: List[Tuple[int, int]] = []
    deleted = set()

    def delete_lines(stmt: ast.stmt) -> None:
        cuts.append((src.starts[stmt.lineno - 1], src.starts[stmt.end_lineno]))
        deleted.update(range(stmt.lineno, stmt.end_lineno + 1))

    for stmt in src.tree.body:
        if (isinstance(stmt, ast.ImportFrom) and stmt.module == ENTRY_MODULE
                and stmt.end_lineno in marked):
            delete_lines(stmt)
    for node in ast.walk(src.tree):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and callee(node.value) == INSTALL and node.end_lineno in marked):
            delete_lines(node)
    for call in [n for n in ast.walk(src.tree) if isinstance(n, ast.Call)]:
        for kw in call.keywords:
            value = kw.value
            if (isinstance(value, ast.Call) and callee(value) == WRAP_EXTRA_ARGS
                    and not value.args and not value.keywords and kw.end_lineno in marked):
                arguments = [a for a in list(call.args) + list(call.keywords) if a is not kw]
                if arguments:
                    last = max(arguments, key=lambda n: (n.end_lineno, n.end_col_offset))
                    cuts.append((src.span(last)[1], src.span(kw)[1]))
                else:
                    cuts.append(src.span(kw))
        if (callee(call) in (WRAP_EXTRA_ARGS, WRAP_MODEL_PROVIDER) and len(call.args) == 1
                and not call.keywords and call.lineno in marked):
            (start, end), (arg_start, arg_end) = src.span(call), src.span(call.args[0])
            cuts += [(start, arg_start), (arg_end, end)]
    for lineno in marked - deleted:
        end = src.line_end(lineno)
        cuts.append((end - len(SUFFIX), end))
    cuts.sort()
    for (_, a_end), (b_start, _) in zip(cuts, cuts[1:]):
        if b_start < a_end:
            raise PatchError(f"{name}: the megatron-flat edits overlap; revert by hand")
    out, pos = [], 0
    for start, end in cuts:
        out.append(data[pos:start])
        pos = end
    out.append(data[pos:])
    return b"".join(out)


@dataclass
class Result:
    data: bytes
    generation: Generation
    notes: List[str]


def patch(data: bytes, name: str = TARGET) -> Result:
    """Patch an unpatched file; checked to parse and to revert to ``data`` byte for byte."""
    src = Source(data, name)
    anchors = find_anchors(src)
    edits = Patch(src)
    anchors.generation.plan(anchors, edits)
    new = edits.result()
    try:
        ast.parse(new)
    except SyntaxError as exc:
        raise PatchError(f"{name}: the patched file would not parse (line {exc.lineno}: "
                         f"{exc.msg}); nothing written")
    if unpatch(new, name) != data:
        raise PatchError(f"{name}: the patch would not revert exactly; nothing written")
    return Result(new, anchors.generation, [text for _, text in sorted(edits.notes)])


@dataclass
class State:
    patched: bool
    generation: Optional[Generation] = None
    problem: Optional[str] = None  # why it cannot be patched (or is only partly patched)


def inspect_state(data: bytes, name: str = TARGET) -> State:
    original = unpatch(data, name)
    try:
        expected = patch(original, name)
    except PatchError as exc:
        return State(original != data, None, str(exc))
    if original == data:
        return State(False, expected.generation)
    if expected.data != data:
        return State(True, expected.generation,
                     f"{name}: partly or differently patched (it differs from what this patcher "
                     "writes); run --revert first")
    return State(True, expected.generation)


# ---------------------------------------------------------------------------- CLI
def core_version(root: Path) -> Optional[str]:
    """megatron-core version from ``megatron/core/package_info.py``, read with ``ast``."""
    info = root / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        return None
    values = {}
    try:
        tree = ast.parse(info.read_bytes())
    except SyntaxError:
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant)):
            values[node.targets[0].id] = node.value.value
    if not all(k in values for k in ("MAJOR", "MINOR", "PATCH")):
        return None
    return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}{values.get('PRE_RELEASE', '')}"


def resolve(target: str) -> Tuple[Path, Path]:
    """(Megatron-LM root, pretrain_gpt.py) for a directory or the file itself."""
    path = Path(target)
    if path.is_dir():
        return path, path / TARGET
    return path.parent, path


def describe(gen: Generation) -> str:
    return f"Megatron-LM {gen.name}-era ({gen.shape})"


def write(path: Path, data: bytes) -> None:
    """Replace ``path`` atomically, keeping its permission bits."""
    mode = path.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def diff(old: bytes, new: bytes, path: Path) -> str:
    return "".join(difflib.unified_diff(
        old.decode().splitlines(keepends=True), new.decode().splitlines(keepends=True),
        fromfile=f"a/{path.name}", tofile=f"b/{path.name}"))


def run(argv: Optional[Sequence[str]] = None, out=None,
        prog: str = "python -m megatron_flat patch") -> int:
    out = out or sys.stdout
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Make Megatron-LM's pretrain_gpt.py accept the --flat-* flags and call "
                    "megatron_flat.install(args) before the model is built.")
    parser.add_argument("megatron_lm", help="Megatron-LM checkout (or its pretrain_gpt.py)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--revert", action="store_true", help="undo the patch exactly")
    mode.add_argument("--check", action="store_true",
                      help="report patched (exit 0) / not patched (exit 1) / cannot patch (2)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the diff that apply or --revert would make; write nothing")
    opts = parser.parse_args(argv)

    def say(msg: str) -> None:
        print(msg, file=out)

    root, path = resolve(opts.megatron_lm)
    if not path.is_file():
        say(f"error: {path} not found (expected a Megatron-LM checkout with {TARGET})")
        return EXIT_REFUSED
    data = path.read_bytes()
    version = core_version(root)
    if version:
        say(f"{path}: megatron-core {version} per megatron/core/package_info.py")
    try:
        state = inspect_state(data, path.name)
        if state.generation:
            say(f"{path}: {describe(state.generation)}")
        if opts.check:
            if state.patched and state.problem is None:
                say(f"{path}: patched")
                return EXIT_OK
            if state.problem:
                say(f"{path}: {'partly patched' if state.patched else 'not patched'}; "
                    f"cannot apply: {state.problem}")
                return EXIT_REFUSED
            say(f"{path}: not patched (would apply cleanly)")
            return EXIT_UNPATCHED
        if opts.revert:
            new = unpatch(data, path.name)
            if new == data:
                say(f"{path}: not patched; nothing to revert")
                return EXIT_OK
            verb = "reverted"
        else:
            if state.problem:
                raise PatchError(state.problem)
            if state.patched:
                say(f"{path}: already patched; nothing to do")
                return EXIT_OK
            result = patch(data, path.name)
            new = result.data
            for note in result.notes:
                say(f"  {note}")
            verb = "patched"
    except PatchError as exc:
        say(f"error: {exc}")
        say(f"{path} left unchanged")
        return EXIT_REFUSED
    if opts.dry_run:
        out.write(diff(data, new, path))
        say(f"{path}: dry run, would be {verb}; nothing written")
        return EXIT_OK
    write(path, new)
    say(f"{path}: {verb}")
    return EXIT_OK


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m megatron_flat patch") -> int:
    """``python -m megatron_flat patch``: see the module docstring."""
    return run(argv, prog=prog)


if __name__ == "__main__":
    sys.exit(run())
