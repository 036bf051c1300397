"""The package's import contract, checked by parsing every module of lorakit/ (tests/unit/test_architecture.py).

The layer order (lowest first) is docs/architecture.md's table. A module may import modules of its own layer and
of layers below it; an import upward is a violation unless it is one of EXCEPTIONS (each documented there). The
import graph (module-level and function-level imports alike) has no cycle. A function-level `import lorakit...`
is allowed only in the CLI (commands import their work when they run, so `lorakit --help` answers fast) or when
the imported module is heavy: it imports torch or another large library when it is imported itself; anywhere
else the import belongs at the top of the module, where the reader sees it.
"""

from __future__ import annotations

import ast
import collections
import sys
from dataclasses import dataclass, field
from pathlib import Path

# lowest first; a module belongs to the first layer one of whose prefixes names it or a package holding it
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("lorakit", "lorakit.errors", "lorakit.quiet", "lorakit.pkgmap", "lorakit.unused", "lorakit.paths", "lorakit.dtypes",
              "lorakit.dist", "lorakit.events")),
    ("io", ("lorakit.io",)),
    ("models", ("lorakit.models",)),
    ("hardware", ("lorakit.hardware",)),
    ("config", ("lorakit.config",)),
    ("data", ("lorakit.data",)),
    ("plan", ("lorakit.plan",)),
    ("cache", ("lorakit.cache",)),
    ("convert", ("lorakit.convert",)),
    ("train", ("lorakit.train",)),
    ("apps", ("lorakit.infer", "lorakit.placement", "lorakit.bench", "lorakit.demo", "lorakit.hub", "lorakit.ui")),
    ("cli", ("lorakit.cli", "lorakit.__main__")),
)
# (importer, imported): upward imports the architecture allows, each with its reason in docs/architecture.md
EXCEPTIONS: dict[tuple[str, str], str] = {}
# third-party packages whose import takes seconds or pulls a GPU runtime
HEAVY = ("torch", "torchvision", "diffusers", "transformers", "peft", "accelerate", "safetensors", "fastsafetensors",
         "bitsandbytes", "optimum", "av", "wandb", "tensorboard", "huggingface_hub", "tokenizers")


@dataclass
class Graph:
    modules: dict[str, Path]
    edges: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # (a, b) -> {"top", "fn"}
    third_party_top: dict[str, set[str]] = field(default_factory=dict)  # module -> top-level third-party roots
    lines: dict[tuple[str, str], int] = field(default_factory=dict)  # first line of each edge


def _module_names(root: Path) -> dict[str, Path]:
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _top_level_nodes(tree: ast.Module) -> set[int]:
    """ids of the import statements that run when the module is imported (module body, incl. if/try blocks)."""
    out = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.add(id(node))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for part in ("body", "orelse", "finalbody", "handlers"):
                todo += getattr(node, part, []) or []
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body
    return out


def build(root: str | Path = None) -> Graph:
    root = Path(root or Path(__file__).resolve().parents[1] / "lorakit")
    g = Graph(_module_names(root))

    def resolve(name: str) -> str | None:
        while name and name not in g.modules:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name or None

    for m, f in g.modules.items():
        tree = ast.parse(f.read_text(), str(f))
        top = _top_level_nodes(tree)
        g.third_party_top[m] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                names = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            kind = "top" if id(node) in top else "fn"
            for n in names:
                if n.split(".")[0] == "lorakit":
                    target = resolve(n)
                    if target and target != m:
                        g.edges.setdefault((m, target), set()).add(kind)
                        g.lines.setdefault((m, target), node.lineno)
                elif kind == "top":
                    g.third_party_top[m].add(n.split(".")[0])
    return g


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        raise KeyError(f"{module} is in no layer of tests/architecture.py")
    return best


def cycles(g: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (each holds an import cycle)."""
    adj = collections.defaultdict(set)
    for a, b in g.edges:
        adj[a].add(b)
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g.modules):
        if v not in index:
            visit(v)
    return out


def heavy_modules(g: Graph) -> set[str]:
    """lorakit modules that import a HEAVY library when imported (directly or through top-level lorakit imports)."""
    heavy = {m for m, roots in g.third_party_top.items() if roots & set(HEAVY)}
    changed = True
    while changed:
        changed = False
        for (a, b), kinds in g.edges.items():
            if "top" in kinds and b in heavy and a not in heavy:
                heavy.add(a)
                changed = True
    return heavy


def violations(root=None) -> list[str]:
    """Every breach of the contract, one line each (empty when the package keeps it)."""
    g = build(root)
    out = []
    for m in g.modules:
        try:
            layer_of(m)
        except KeyError as e:
            out.append(str(e))
    if out:
        return out
    for comp in cycles(g):
        out.append("import cycle: " + " -> ".join(comp))
    heavy = heavy_modules(g)
    for (a, b), kinds in sorted(g.edges.items()):
        la, lb = layer_of(a), layer_of(b)
        where = f"{g.modules[a].name}:{g.lines[(a, b)]}"
        if lb > la and (a, b) not in EXCEPTIONS:
            out.append(f"upward import: {a} ({LAYERS[la][0]}) imports {b} ({LAYERS[lb][0]}) at {where}")
        if "fn" in kinds and not a.startswith("lorakit.cli") and b not in heavy:
            out.append(f"function-level import of a light module: {a} imports {b} inside a function at {where} "
                       "(import it at the top)")
    return out


def summary(root=None) -> dict:
    g = build(root)
    up = [(a, b) for (a, b) in g.edges if layer_of(b) > layer_of(a)] if all(
        _safe_layer(m) for m in g.modules) else []
    sizes = sorted(((len(p.read_text().splitlines()), m) for m, p in g.modules.items()), reverse=True)
    return {"modules": len(g.modules), "edges": len(g.edges), "cycles": len(cycles(g)), "upward": len(up),
            "function_level": sum(1 for k in g.edges.values() if "fn" in k), "largest": sizes[:5]}


def _safe_layer(m: str) -> bool:
    try:
        layer_of(m)
        return True
    except KeyError:
        return False


if __name__ == "__main__":
    import json

    print(json.dumps(summary(sys.argv[1] if len(sys.argv) > 1 else None), indent=1))
    for v in violations(sys.argv[1] if len(sys.argv) > 1 else None):
        print(v)
