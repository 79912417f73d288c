"""The C side: `ffi` and `lib` of the cffi API-mode extension `_ct`."""
from ._ct import ffi as ffi, lib as lib
