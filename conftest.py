"""pytest, for the notebooks and tests alike: figures saved during a test run go to a
temporary folder (the kernels nbval starts inherit the variable), so running the
tests never rewrites the committed figures in figures/."""

import os
import tempfile

os.environ.setdefault("KVLIB_SAVE_FIGURES", tempfile.mkdtemp(prefix="kvlib-figures-"))

# Notebooks whose new versions were not re-executed against the final kvlib before the session
# that merged them ended (see that session's closing note): their stored outputs are missing or
# stale, so nbval has nothing true to compare. Re-execute each one and take it off this list.
collect_ignore = [
    "notebooks/08-quantized-and-windowed-caches.ipynb",
]
