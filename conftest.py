"""pytest, for the notebooks and tests alike: figures saved during a test run go to a
temporary folder (the kernels nbval starts inherit the variable), so running the
tests never rewrites the committed figures in figures/."""

import os
import tempfile

os.environ.setdefault("KVLIB_SAVE_FIGURES", tempfile.mkdtemp(prefix="kvlib-figures-"))
