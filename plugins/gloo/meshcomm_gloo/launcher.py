"""``meshcomm launch --backend gloo`` support: the environment each rank needs to rendezvous."""

from __future__ import annotations

from meshcomm.plugin import JobSpec

from .placing import is_address

__all__ = ["GlooLauncher"]


class GlooLauncher:
    """Rank 0 hosts the rendezvous TCPStore on a free port of its host; every rank gets its address."""

    def rank_env(self, job: JobSpec) -> list[dict[str, str]]:
        """One environment per rank (index = rank): store address and port, and the world size."""
        if not job.places:
            raise ValueError("gloo launcher: the job has no ranks (places is empty); pass -n N with N >= 1")
        first = job.places[0]
        port = job.free_port(first)
        if not 0 < int(port) < 65536:
            raise ValueError(
                f"gloo launcher: free_port returned {port!r} for rank 0's host {first.host or 'localhost'}"
            )
        env = {
            "MESHCOMM_GLOO_ADDR": first.ip,
            "MESHCOMM_GLOO_PORT": str(int(port)),
            "MLX_WORLD_SIZE": str(job.nranks),
        }
        # each rank's own address for its data connections (when it is an IP address: the host
        # name may resolve to a loopback address, which breaks a job across hosts)
        return [{**env, **({"MESHCOMM_GLOO_HOST": p.ip} if is_address(p.ip) else {})} for p in job.places]
