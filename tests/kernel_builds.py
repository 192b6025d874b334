"""Parameters that run a native-kernel test once per build of the kernel (``loss/native.py``): the one
for this CPU (``-march=native``) and the one for the architecture's baseline instruction set
(``-march=x86-64`` on x86-64), selected by tests/conftest.py's ``native_isa`` marker.

``NATIVE_BUILDS`` parametrizes a test that calls the kernel directly (an argument ``build``);
``COMPILED`` and ``COMPILED_NATIVE`` are the ``compile=`` values of the fused loss with the native
kernel in both builds."""

import pytest

BASELINE = pytest.mark.native_isa("baseline")
NATIVE_BUILDS = pytest.mark.parametrize("build", ["native", pytest.param("baseline", marks=BASELINE)])
NATIVE_BASELINE = pytest.param("native", marks=BASELINE, id="native-baseline")
COMPILED = pytest.mark.parametrize("compiled", [pytest.param(False, id="eager"), "native", NATIVE_BASELINE])
