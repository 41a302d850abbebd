"""The compiled call path of the core (setuptools reads C extensions here; it is built against
NumPy's headers, so NumPy is a build requirement).

``optional=True``: where no C compiler or Python headers exist, a build from the sdist goes
on without the extension and the core runs its pure-Python call path (the same behaviour);
``meshcomm info`` says which one is installed.
"""

import numpy
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "meshcomm.api._callpath",
            ["core/meshcomm/api/_callpath.c"],
            include_dirs=[numpy.get_include()],  # NumPy's C API: the result arrays are made without a call
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        )
    ]
)
