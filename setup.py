"""The compiled call path of the core (setuptools reads C extensions here).

``optional=True``: where no C compiler or Python headers exist, a build from the sdist goes
on without the extension and the core runs its pure-Python call path (the same behaviour);
``meshcomm info`` says which one is installed.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "meshcomm.api._callpath",
            ["core/meshcomm/api/_callpath.c"],
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        )
    ]
)
