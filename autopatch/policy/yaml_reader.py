"""A policy file read with ``yaml.safe_load`` semantics only (it can never build Python objects),
by a loader that also refuses what safe_load lets through: a key given twice, nesting past
``MAX_DEPTH``, aliases that would repeat more than ``MAX_REPEATED`` (a "billion laughs"), a file
over ``MAX_FILE_BYTES`` or not UTF-8. Values that arrive otherwise (environment variables,
``enable()`` arguments) get the same bounds from ``plain_data``."""

import yaml

from .messages import PolicyError, cut, cut_message

MAX_FILE_BYTES = 1 << 20   # a policy is a few hundred bytes
MAX_DEPTH = 16             # the deepest policy value is 4 levels down (data: cache: backend:)
MAX_REPEATED = 10_000      # nodes and characters all aliases of a file may repeat, in all


class _Refused(yaml.MarkedYAMLError):
    """What ``_StrictLoader`` refuses beyond what PyYAML does: the problem names the key."""


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader (plain data only), bounded: nesting past ``MAX_DEPTH`` and aliases
    repeating more than ``MAX_REPEATED`` nodes and characters in all are refused while composing,
    before anything is expanded; so are an alias inside the node it names (a cycle) and integers
    past Python's digit limit."""

    def __init__(self, text):
        super().__init__(text)
        self._path = []       # the keys above the node being composed (None: a list item or a key)
        self._sizes = {}      # id(node) -> the nodes and characters it stands for, expanded
        self._repeated = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            if event.anchor in self.anchors:     # else the composer's own error
                self._repeat(event)
            return super().compose_node(parent, index)
        self._path.append(index.value if isinstance(index, yaml.ScalarNode) else None)
        try:
            if len(self._path) > MAX_DEPTH:
                self._refuse(f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            node = super().compose_node(parent, index)
        finally:
            self._path.pop()
        self._sizes[id(node)] = self._size(node)
        return node

    def _refuse(self, problem, mark):
        key = ".".join(k for k in self._path if isinstance(k, str))
        raise _Refused(problem=f"key '{cut(key)}': {problem}" if key else problem, problem_mark=mark)

    def _size(self, node):
        if isinstance(node, yaml.ScalarNode):
            return 1 + len(node.value)
        children = node.value if isinstance(node, yaml.SequenceNode) else [n for kv in node.value for n in kv]
        return 1 + sum(self._sizes[id(child)] for child in children)

    def _repeat(self, event):
        size = self._sizes.get(id(self.anchors[event.anchor]))
        if size is None:
            self._refuse(f"alias *{cut(event.anchor)} inside the node it names", event.start_mark)
        self._repeated += size
        if self._repeated > MAX_REPEATED:
            self._refuse(f"aliases repeat more than {MAX_REPEATED} nodes and characters in all "
                         "(a policy needs a few)", event.start_mark)

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:     # more digits than int() takes
            raise _Refused(problem=f"an integer of {len(node.value)} digits", problem_mark=node.start_mark) from None


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)


def _key_lines(root, where):
    """Map dotted key -> 1-based line of that key; a key given twice in one mapping is an error."""
    out = {}

    def walk(node, prefix):
        if isinstance(node, yaml.SequenceNode):
            for child in node.value:
                walk(child, prefix)
        if not isinstance(node, yaml.MappingNode):
            return
        first = {}
        for k, v in node.value:
            if k.tag == "tag:yaml.org,2002:merge" or not isinstance(k, yaml.ScalarNode):
                walk(v, prefix)
                continue
            key, line = f"{prefix}{k.value}", k.start_mark.line + 1
            if (k.tag, k.value) in first:
                raise PolicyError(f"{where}:{line}: key '{cut(key)}' is given twice in one mapping "
                                  f"(first on line {first[k.tag, k.value]})")
            first[k.tag, k.value] = out[key] = line
            walk(v, key + ".")
    walk(root, "")
    return out


def plain_data(value):
    """``value`` when it is plain data a policy could hold: nested at most ``MAX_DEPTH`` deep, at
    most ``MAX_FILE_BYTES`` nodes and characters in all (a value of shared lists counts each
    time it is reached), text that is valid UTF-8 (an environment variable holding other bytes
    arrives with surrogates). The checks a policy file gets from its loader, for variables and
    ``enable()`` arguments; ValueError else."""
    budget, stack = MAX_FILE_BYTES, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
        items = [*v.keys(), *v.values()] if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else ()
        budget -= 1 + len(items) + (len(v) if isinstance(v, str) else 0)
        if budget < 0:
            raise ValueError(f"larger than a policy may be ({MAX_FILE_BYTES} nodes and characters)")
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                code = ord(v[e.start])     # 0xdc80-0xdcff: a byte os.environ could not decode
                what = f"byte 0x{code - 0xdc00:02x}" if 0xdc80 <= code <= 0xdcff else f"U+{code:04X}"
                raise ValueError(f"not valid UTF-8 text: {what} at character {e.start + 1}") from None
        stack.extend((item, depth + 1) for item in items)
    return value


def read_policy_file(path):
    """(the parsed document, dotted key -> line): at most ``MAX_FILE_BYTES`` of UTF-8, through
    ``_StrictLoader``, composed once for both."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise PolicyError(f"{path}: cannot read policy file: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise PolicyError(f"{path}: a policy file is at most {MAX_FILE_BYTES} bytes; this one is larger")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line, line_start = data.count(b"\n", 0, e.start) + 1, data.rfind(b"\n", 0, e.start) + 1
        raise PolicyError(f"{path}:{line}: not UTF-8 text: byte 0x{data[e.start]:02x} at column "
                          f"{e.start - line_start + 1}") from None
    lines = {}
    try:
        loader = _StrictLoader(text)
        try:
            root = loader.get_single_node()
            lines = _key_lines(root, path)
            return None if root is None else loader.construct_document(root), lines
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise PolicyError(_yaml_error(path, e, text, lines)) from None


def _yaml_error(path, error, text, lines):
    """``path:line: problem``: the line the error points at, the key on that line when the
    document was composed, and PyYAML's own refusals called syntax errors."""
    problem = cut_message(getattr(error, "problem", None) or str(error).splitlines()[0])
    if not isinstance(error, _Refused):
        problem = f"YAML syntax error: {problem}"
    mark = getattr(error, "problem_mark", None)
    position = getattr(error, "position", None)    # the reader's: a character YAML does not allow
    if mark is not None:
        line = mark.line + 1
    elif position is not None:
        line = text.count("\n", 0, position) + 1
    else:
        return f"{path}: {problem}"
    on_line = [key for key, at in lines.items() if at == line]
    if on_line and not problem.startswith("key '"):
        problem = f"key '{cut(max(on_line, key=len))}': {problem}"
    return f"{path}:{line}: {problem}"
