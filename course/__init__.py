"""The course's own tooling, kept out of kvlib so that kvlib holds only the final code; here the
printed line's width, which every module's printing keeps to."""

import textwrap

WIDTH = 100  # characters of a printed line: a browser's output area breaks longer ones anywhere


def wrapped(text: str, indent: str = "  ") -> str:
    """Each line of ``text`` broken at word boundaries to ``WIDTH``, never inside a word or a
    number; the continuation lines indented."""
    return "\n".join(textwrap.fill(line, WIDTH, subsequent_indent=indent, break_long_words=False,
                                   break_on_hyphens=False) for line in text.splitlines())


def say(text: str) -> None:
    """Print ``text`` :func:`wrapped`."""
    print(wrapped(text))
