"""The compiled shared-memory loop of meshcomm-sockets (setuptools reads C extensions here).

``optional=True``: where no C compiler or Python headers exist, a build from the sdist goes
on without the extension and the backend runs its pure-Python loop (the same protocol, so
ranks with and without it work together); ``meshcomm info`` says which loop is installed.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "meshcomm_sockets._shm",
            ["meshcomm_sockets/_shm.c"],
            extra_compile_args=["-O2", "-ftree-vectorize", "-Wall"],
            optional=True,
        )
    ]
)
