"""The C extension of meshcomm-sockets-native (setuptools needs it declared here)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "meshcomm_sockets_native._shm",
            ["meshcomm_sockets_native/_shm.c"],
            extra_compile_args=["-O2", "-ftree-vectorize", "-Wall"],
        )
    ]
)
