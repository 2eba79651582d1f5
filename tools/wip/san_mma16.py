"""sanitize_cases.py's paged cases, mma16 only (the flat schedule and the merge in the
attention kernel), for a quick memcheck / racecheck run."""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("sc", ".ci/sanitize_cases.py")
sc = importlib.util.module_from_spec(spec); spec.loader.exec_module(sc)
sc.PAGED_VARIANTS = ("mma16",)
sc.WGMMA_VARIANTS = ()
sys.exit(sc.paged_cases())
