"""The optional C extension: region-of-interest JPEG decode against the system's libjpeg.

Everything else is in pyproject.toml. Without libjpeg's headers (Debian: libjpeg-dev) the
build goes on without it, and raying decodes whole JPEGs with simplejpeg instead
(``raying.image.decode.ROI_DECODE`` says which is in use).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("raying.image._jpegroi", ["raying/image/_jpegroi.c"],
                             libraries=["jpeg"], extra_compile_args=["-O2"],
                             optional=True)])
