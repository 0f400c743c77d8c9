"""The files of a profiler folder, one home for its layout (as :mod:`.trace.format` is the trace folder's).

One ``QuantAnalysis`` out_dir (one stage pair of ``quantlens analyze``) holds the two traces, the bad case, the
reports and what renders them again; the ``quantlens analyze`` folder above the pairs holds the index and the
summary. Every module that reads or writes one of these files takes its name from here.
"""

from __future__ import annotations

__all__ = ["BASELINE_DIR", "ANALYSIS_DIR", "BAD_CASE_FILE", "ALL_BAD_CASE_FILE", "BAD_CASE_TEXT", "BAD_CASE_HTML",
           "COMPARE_TEXT", "COMPARE_CSV", "COMPARISON_FILE", "FACTS_FILE", "ADVISOR_FILE", "PROFILER_HTML",
           "sensitivity_stem", "PAIR_FILE", "SUMMARY_FILE", "INDEX_FILE"]

# -- one pair's folder (QuantAnalysis out_dir) -------------------------------------------------------------------
#: the two traces (their own files: :mod:`.trace.format`)
BASELINE_DIR, ANALYSIS_DIR = "baseline_model", "analysis_model"
#: the bad case (the inputs both models were traced on), every sample's metrics, and both in words
BAD_CASE_FILE, ALL_BAD_CASE_FILE = "badcase.pt", "all_badcase_info.pt"
BAD_CASE_TEXT, BAD_CASE_HTML = "badcase.txt", "badcase_report.html"
#: the per-layer comparison in words and as CSV, and its rows saved for ``quantlens report`` (:mod:`.compare_cache`)
COMPARE_TEXT, COMPARE_CSV, COMPARISON_FILE = "compare_per_layer_out.txt", "compare_per_layer_out.csv", \
    "compare_per_layer.json"
#: what the reports read besides the traces (:mod:`.pair_facts`)
FACTS_FILE = "pair_facts.json"
#: the advisor's findings and the page
ADVISOR_FILE, PROFILER_HTML = "abnormal_layer_advisor.txt", "profiler.html"


def sensitivity_stem(output: str, metric: str) -> str:
    """``output_<name>_<metric>_sensitive_ops`` (``.txt`` and ``.pt``): one sensitivity table (``output`` already
    made safe for a file name)."""
    return f"output_{output}_{metric}_sensitive_ops"


# -- the ``quantlens analyze`` folder above the pairs -----------------------------------------------------------
#: what ``quantlens analyze`` knew of a pair (its analysis type, the models' stages), read by ``quantlens report``
PAIR_FILE = "quantlens_pair.json"
#: the answer over all pairs, and the page linking each pair's
SUMMARY_FILE, INDEX_FILE = "summary.json", "index.html"
