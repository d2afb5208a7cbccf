"""Attempts, hints and verdicts: what every exercise check shares.

A check prints exactly one verdict, so a notebook's stored output stays the same run after run:

- ``not attempted yet`` while the learner's function still raises ``NotImplementedError`` (the
  stub a notebook ships), so a fresh notebook runs top to bottom without a traceback;
- ``correct`` when every expectation holds (a check may print a note on the next line);
- otherwise one line naming the numbers that differ, with a hint when the wrong answer is a
  mistake the check knows.

A check is a function decorated with :func:`check`: it calls the learner's function through
:func:`attempt` and states what must hold with :func:`expect`, the first failure being the
verdict::

    @check
    def check_double(fn):
        for x in (1, 7):
            got = attempt(fn, x)
            expect(got == 2 * x, f"double({x}): you returned {got}, expected {2 * x}.",
                   hint(got, {x: "Multiply, do not copy."}))
"""

from __future__ import annotations

import functools

NOT_ATTEMPTED = "not attempted yet"
CORRECT = "correct"


class _NotAttempted(Exception):
    """The learner's function is still the stub."""


class _Wrong(Exception):
    """An expectation failed; the message is the verdict."""


class _Hidden(Exception):
    """The learner's function called a helper the exercise asks them to build."""


def attempt(fn, *args, hide: tuple = ()):
    """``fn(*args)``, where a ``NotImplementedError`` ends the check as not attempted.

    Only the learner's call is guarded: a ``NotImplementedError`` from the check's own code (the
    ``meta`` device raises it for ops it cannot run) stays a bug to see, not a verdict.

    ``hide``: ``(owner, name)`` pairs, helpers the exercise asks the learner to build rather than
    call. During the call each is replaced, on its owner (a module or class) and among the names
    ``fn`` sees, by one that ends the check saying so; a module's own names stay as they are for
    a function defined in it.
    """
    undo, seen = [], getattr(fn, "__globals__", {})
    for owner, name in hide:
        if seen is getattr(owner, "__dict__", None):
            continue  # a module's own functions (the reference solutions) are not hidden from it
        original = getattr(owner, name)

        def refuse(*_, name=name, **__):
            raise _Hidden(name)

        setattr(owner, name, refuse)
        undo.append(lambda owner=owner, name=name, original=original:
                    setattr(owner, name, original))
        for key in [key for key, value in seen.items() if value is original]:
            seen[key] = refuse
            undo.append(lambda key=key, original=original: seen.__setitem__(key, original))
    try:
        return fn(*args)
    except NotImplementedError:
        raise _NotAttempted from None
    except _Hidden as hidden:
        raise _Wrong(f"This exercise builds what `{hidden}` does: your function called it. Write "
                     f"it from the pieces the exercise names.") from None
    finally:
        for restore in reversed(undo):
            restore()


def expect(ok: bool, message: str, hint: str = "") -> None:
    """End the check with ``message + hint`` as its verdict unless ``ok``."""
    if not ok:
        raise _Wrong(message + hint)


def hint(got, known: dict, default: str = "") -> str:
    """The hint for a known wrong answer, `` text`` ready to append to a message.

    ``known`` maps each wrong answer the check knows to its hint; ``default`` (or nothing) when
    ``got`` is none of them. Compared with ``==``, so an unhashable answer is no error.
    """
    text = next((text for wrong, text in known.items() if got == wrong), default)
    return f" {text}" if text else ""


def check(body):
    """Make ``body(fn)`` a check that prints one verdict.

    A string ``body`` returns is a note, printed on the line after ``correct``.
    """

    @functools.wraps(body)
    def run(fn) -> None:
        try:
            note = body(fn)
        except _NotAttempted:
            print(NOT_ATTEMPTED)
        except _Wrong as wrong:
            print(wrong)
        else:
            print(CORRECT)
            if note:
                print(note)

    return run
