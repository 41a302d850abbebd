"""The compiled small all_sum of meshcomm-mpi (setuptools reads C extensions here).

``optional=True``: where no C compiler or Python headers exist, a build from the sdist goes
on without the extension and the backend runs the same steps in Python; ``meshcomm info``
says which one is installed. The extension needs no MPI headers (meshcomm_mpi.compiled).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "meshcomm_mpi._planned",
            ["meshcomm_mpi/_planned.c"],
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        )
    ]
)
