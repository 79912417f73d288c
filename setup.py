# cffi has no pyproject-only form for API-mode modules yet (cffi#55): this
# file exists only to name the extension builder.
from setuptools import setup

setup(cffi_modules=["launcher/_native/build.py:ffibuilder"])
