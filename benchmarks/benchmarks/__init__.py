"""lorahook's asv suite: see docs/guide/benchmarks.md."""
import os


def module_setup(module):
    """A module-level ``setup`` that skips the module's benchmarks where they are not measured.

    ``LORAHOOK_ASV_ONLY`` (set by an environment of ``asv.conf.json``) names the
    suite modules an environment measures, comma-separated; unset, it measures
    them all.  asv runs a module's ``setup`` before each of its benchmarks, so a
    benchmark is measured in one environment rather than in each.
    """
    name = module.rsplit(".", 1)[-1]

    def setup(*params):
        only = os.environ.get("LORAHOOK_ASV_ONLY")
        if only and name not in {m.strip() for m in only.split(",")}:
            raise NotImplementedError  # measured in another environment

    return setup
