"""Tables in Markdown, pasted as they are into RESULTS.md."""


def markdown(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def first_line(text):
    """The line that says what went wrong: a traceback's last, or else the first (200 characters)."""
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines and lines[0].startswith("Traceback") else lines[0] if lines else "")[:200]


def log(msg):
    """A line of progress, printed at once: a run takes minutes and its output may go to a pipe."""
    print(msg, flush=True)
