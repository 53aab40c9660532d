"""torchtitan 0.3's command-line keys, read from its installed source with `ast` (never imported:
its dependencies are not installed). torchtitan 0.3 builds its config from dataclasses and
parses `--section.key=value` with tyro: Trainer.Config (torchtitan/trainer.py) holds one field
per section, each a dataclass whose fields are the keys; a nested dataclass field is a nested
section (`--loss.loss_fn.key`), as tyro names it. tyro narrows a field to the type of its
default, so a section's keys are those of its default_factory's class (CheckpointManager.Config
under `checkpoint: BaseCheckpointManager.Config`). A union of dataclasses is a tyro subcommand
(activation_checkpoint:selective | full | memory-budget | none): every member's keys count.

Left out, with the reason: fields annotated tyro.conf.Suppress (Trainer.Config.model_spec: the
model architecture, quantization and LoRA converters sit inside it and are set in Python by the
model registry, never on the command line), ClassVar and `_private` fields (not dataclass
fields tyro shows), and Trainer.Config's top-level plain keys (hf_assets_path, dump_folder),
which have no section (ctitan's are model.hf_assets_path and job.dump_folder)."""
import ast
import os

TT = os.path.join(os.path.dirname(__file__), "..", "..", ".venv", "lib", "python3.11", "site-packages",
                  "torchtitan")


class _Src:
    def __init__(self, root):
        self.root = os.path.realpath(root)
        self.pkg_parent = os.path.dirname(self.root)
        self.trees = {}

    def tree(self, mod):
        if mod not in self.trees:
            rel = mod.replace(".", os.sep)
            for p in (os.path.join(self.pkg_parent, rel + ".py"), os.path.join(self.pkg_parent, rel, "__init__.py")):
                if os.path.exists(p):
                    with open(p) as f:
                        self.trees[mod] = (ast.parse(f.read()), p.endswith("__init__.py"))
                    break
            else:
                self.trees[mod] = (None, False)
        return self.trees[mod][0]

    def _abs(self, mod, node):
        if not node.level:
            return node.module
        parts = mod.split(".")
        is_pkg = self.trees[mod][1]
        base = parts if is_pkg else parts[:-1]
        base = base[:len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def lookup(self, mod, name, depth=0):
        """The ast node named `name` at module level of `mod` (following imports): ClassDef or Assign."""
        t = self.tree(mod)
        if t is None or depth > 8:
            return None
        for n in t.body:
            if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name:
                return mod, n
            if isinstance(n, ast.Assign) and any(isinstance(x, ast.Name) and x.id == name for x in n.targets):
                return mod, n
        for n in ast.walk(t):
            if isinstance(n, ast.ImportFrom):
                for a in n.names:
                    if (a.asname or a.name) == name:
                        src = self._abs(mod, n)
                        got = self.lookup(src, a.name, depth + 1)
                        if got:
                            return got
                        if self.tree(src + "." + a.name) is not None:
                            return src + "." + a.name, None
        return None

    def resolve(self, mod, expr):
        """A Name / Attribute expression in `mod` to (module, ClassDef) or (module, Assign)."""
        if isinstance(expr, ast.Name):
            return self.lookup(mod, expr.id)
        if isinstance(expr, ast.Attribute):
            outer = self.resolve(mod, expr.value)
            if not outer:
                return None
            omod, node = outer
            if node is None:  # a module
                return self.lookup(omod, expr.attr)
            if isinstance(node, ast.ClassDef):
                for n in node.body:
                    if isinstance(n, ast.ClassDef) and n.name == expr.attr:
                        return omod, n
        return None


def _is_dataclass(cls):
    for d in cls.decorator_list:
        f = d.func if isinstance(d, ast.Call) else d
        if getattr(f, "id", None) == "dataclass" or getattr(f, "attr", None) == "dataclass":
            return True
    return False


def _suppressed(ann):
    return "Suppress" in ast.unparse(ann)


def _strip(ann):
    """Annotated[X, ...] -> X; X | None -> [X]; a union -> its members."""
    if isinstance(ann, ast.Subscript) and ast.unparse(ann.value).endswith("Annotated"):
        return _strip(ann.slice.elts[0])
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return _strip(ann.left) + _strip(ann.right)
    if isinstance(ann, ast.Constant) and ann.value is None:
        return []
    return [ann]


def _default(value, src=None, mod=None):
    """(has_literal_default, value) of a field's default expression (a module constant followed)."""
    if value is None:
        return False, None
    if isinstance(value, ast.Name) and src is not None:
        got = src.lookup(mod, value.id)
        if got and isinstance(got[1], ast.Assign):
            return _default(got[1].value)
    if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("field"):
        for kw in value.keywords:
            if kw.arg == "default":
                return _default(kw.value, src, mod)
            if kw.arg == "default_factory":
                f = kw.value
                if isinstance(f, ast.Name) and f.id in ("list", "dict"):
                    return True, [] if f.id == "list" else {}
                if isinstance(f, ast.Lambda):
                    try:
                        return True, ast.literal_eval(f.body)
                    except ValueError:
                        return False, None
        return False, None
    try:
        return True, ast.literal_eval(value)
    except ValueError:
        return False, None


def _factory(value):
    if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("field"):
        for kw in value.keywords:
            if kw.arg == "default_factory":
                return kw.value
    return None


def _fields(src, mod, cls, seen=()):
    """The dataclass fields of cls, its bases' first: [(module, name, annotation, default expr)]."""
    out = []
    for b in cls.bases:
        got = src.resolve(mod, b)
        if got and isinstance(got[1], ast.ClassDef) and got[1] not in seen:
            out += _fields(src, got[0], got[1], seen + (cls,))
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            if "ClassVar" in ast.unparse(n.annotation) or n.target.id.startswith("_"):
                continue
            out = [f for f in out if f[1] != n.target.id] + [(mod, n.target.id, n.annotation, n.value)]
    return out


def _section_classes(src, mod, ann, value):
    """The dataclasses a field stands for (tyro: the default's type, or each member of a union)."""
    fac = _factory(value)
    members = []
    for m in _strip(ann):
        got = src.resolve(mod, m)
        if got and isinstance(got[1], ast.Assign):  # a type alias: a union is a tyro subcommand
            members += _strip(got[1].value)
    if not members:
        members = [fac] if fac is not None and not isinstance(fac, ast.Lambda) else _strip(ann)
    out = []
    for m in members:
        got = src.resolve(mod, m)
        if got and isinstance(got[1], ast.ClassDef) and _is_dataclass(got[1]):
            out.append(got)
    return out


def _walk(src, mod, cls, prefix, out, skipped, given=None):
    """given: {field: Call} of a config registry's Config(...) call: the classes it narrows fields to."""
    given = given or {}
    for fmod, name, ann, value in _fields(src, mod, cls):
        if _suppressed(ann):
            skipped.append((prefix + name, "tyro.conf.Suppress"))
            continue
        call = given.get(name)
        if call is not None:
            got = src.resolve(given["__mod__"], call.func)
            if got and isinstance(got[1], ast.ClassDef) and _is_dataclass(got[1]):
                sub = {k.arg: k.value for k in call.keywords if isinstance(k.value, ast.Call)}
                sub["__mod__"] = given["__mod__"]
                _walk(src, got[0], got[1], prefix + name + ".", out, skipped, sub)
                continue
        subs = _section_classes(src, fmod, ann, value)
        if subs:
            for smod, scls in subs:
                _walk(src, smod, scls, prefix + name + ".", out, skipped)
            continue
        has, dv = _default(value, src, fmod)
        out[prefix + name] = (has, dv, ast.unparse(ann))  # the registry's narrower class (walked last) wins


def torchtitan_keys(root=TT):
    """{"section.key": (has_literal_default, default, annotation text)} of torchtitan 0.3's
    Trainer.Config, and [(name, why)] of the fields left out."""
    src = _Src(root)
    mod, trainer = src.lookup("torchtitan.trainer", "Trainer")
    cfg = next(n for n in trainer.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    out, skipped = {}, []
    _walk(src, mod, cfg, "", out, skipped)
    # `--module qwen3 --config qwen3_debugmodel` (ctitan's model family): tyro narrows each section
    # to the class the registry's Trainer.Config(...) call gives it (its dataloader, its loss)
    rmod = "torchtitan.models.qwen3.config_registry"
    fn = src.lookup(rmod, "qwen3_debugmodel")[1]
    call = next(n.value for n in fn.body if isinstance(n, ast.Return))
    given = {k.arg: k.value for k in call.keywords if isinstance(k.value, ast.Call)}
    given["__mod__"] = rmod
    _walk(src, mod, cfg, "", out, skipped, given)
    top = [k for k in out if "." not in k]
    for k in top:
        skipped.append((k, "top-level key without a section"))
        del out[k]
    return out, skipped


if __name__ == "__main__":
    keys, skipped = torchtitan_keys()
    for k, v in keys.items():
        print(k, v)
    print(len(keys), "keys; skipped", skipped)
