"""``QuantAnalysis``: the profiler's facade (the seed article's debug tool for torch stages).

    qa = QuantAnalysis(float_model, calib_model, "fake_quant", out_dir="./float_vs_calib")
    qa.auto_find_bad_case(calibration_batches)      # or qa.set_bad_case(example) / qa.load_bad_case()
    qa.run()                                        # traces both models on the bad case
    table = qa.compare_per_layer()                  # per-op metrics, same-input error, advisor, HTML
    sens = qa.sensitivity()                         # feeds sensitive_op_..._qconfig_setter(sens, topk=k)
    joint = qa.joint_sensitivity(pairs=6)           # one op at a time, pairs, the share of the error explained

Each method returns its result as data and writes its report files into ``out_dir`` (and nowhere else).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from quantlens._io import check_writable, writable_dir_problem
from quantlens._threads import loop_threads
from quantlens.errors import QuantLensError
from quantlens.profiler.access_factory import make_access
from quantlens.profiler.advisor import AdvisorContext, Finding, advise
from quantlens.profiler.bad_case import BadCaseResult, find_bad_case
from quantlens.profiler.bad_case_io import read_bad_case, refuse_empty
from quantlens.profiler.bad_case_shapes import check_bad_case_shapes
from quantlens.profiler.cached_attrs import install_cached_attrs
from quantlens.profiler.compare import LayerComparison, check_site_match, compare_traces
from quantlens.profiler.eager_check import check_baseline
from quantlens.profiler.fingerprint import check_made_from
from quantlens.profiler.joint_sensitivity import JointSensitivityResult, run_joint_sensitivity, write_joint_sensitivity
from quantlens.profiler.model_access import AnalysisType, ConsistencyInfo, parse_analysis_type
from quantlens.profiler.outputs import PostProcess
from quantlens.profiler.pair_checks import check_deployed_pair, check_weights_correspond
from quantlens.profiler.pair_facts import FACTS_FILE, PairFacts, find_facts, save_facts, with_sensitivity
from quantlens.profiler.reach import SiteReach, mark, reached_only, site_reach
from quantlens.profiler.report import (
    keeping,
    save_pt,
    write_advisor,
    write_bad_case,
    write_compare_text,
    write_comparison,
    write_sensitivity,
)
from quantlens.profiler.report_files import (
    ADVISOR_FILE,
    ALL_BAD_CASE_FILE,
    ANALYSIS_DIR,
    BAD_CASE_FILE,
    BAD_CASE_TEXT,
    BASELINE_DIR,
    COMPARE_TEXT,
)
from quantlens.profiler.row_stream import RowStream
from quantlens.profiler.run_result import RunResult
from quantlens.profiler.run_trace import trace_model
from quantlens.profiler.sensitivity import SensitivityResult, run_sensitivity
from quantlens.profiler.trace.folder_lock import FolderLock
from quantlens.profiler.trace.reader import TraceReader
from quantlens.profiler.trace.stats import input_digest
from quantlens.profiler.trace.writer import HOLD_BYTES
from quantlens.profiler.trace_pair import open_trace_pair
from quantlens.quantization.fake_quantize import uncalibrated_message, uncalibrated_sites

__all__ = ["QuantAnalysis", "RunResult"]



class QuantAnalysis:
    """Compare a baseline model with an analysis model, op site by op site.

    Args:
        baseline_model: the reference: the float model (``fake_quant``), the QAT model (``pre_export``), the
            pre_export model (``export``), the qat IR or the pre_export model (``convert``). IR models may be
            given as the path of a file written by ``save``.
        analysis_model: the model under investigation: the calibration/QAT model returned by ``prepare``
            (``fake_quant``), the pre_export model (``pre_export``), the qat IR (``export``) or the quantized IR
            (``convert``).
        analysis_model_type: ``"fake_quant"``, ``"pre_export"``, ``"export"`` or ``"convert"``. The IR accepts the
            bad case as the torch input pytree, in the deployment format (the same without its non-tensor
            leaves, e.g. the dict without the task list) or as a dict of tensors by input name.
        out_dir: where every report and trace goes. Defaults to ``./quant_analysis``.
        post_process: optional callable or module applied to both models' outputs (host-side float code); its
            results are compared like model outputs (named ``post_process[.<name>]``).
        progress: show rich progress bars for the long loops. Defaults to True.
        cached_attrs: attribute paths (``"decoder.memory"``) of state the torch modules keep between calls (a
            sequence model's memory): before each analysis call they are set to copies of the baseline's values at
            the start of its latest call, so both models start from the same state.
        allow_uncalibrated: analyse a prepared model some of whose activation fake quants never saw data (their
            placeholder scale 1.0 would top every ranking); refused by default, naming those op sites.

    Profiling never changes the models: forwards run in eval mode, without gradients, with observers paused,
    and every flag is restored afterwards.
    """

    def __init__(self, baseline_model: Any, analysis_model: Any, analysis_model_type: str,
                 out_dir: str | os.PathLike = "./quant_analysis", post_process: Any = None, *, progress: bool = True,
                 cached_attrs: Iterable[str] | str | None = None, allow_uncalibrated: bool = False):
        self.analysis_type = parse_analysis_type(analysis_model_type)
        self.baseline = make_access(baseline_model, "baseline")
        self.analysis = make_access(analysis_model, "analysis")
        self.cached_attrs = install_cached_attrs(self.baseline, self.analysis, cached_attrs)
        check_deployed_pair(self.analysis_type, self.baseline, self.analysis)
        never = uncalibrated_sites(self.analysis.model) if getattr(self.analysis, "prepared", False) else []
        if never and not allow_uncalibrated:  # its placeholder scales would be blamed as the culprits
            raise QuantLensError(uncalibrated_message("QuantAnalysis: the analysis model", never)
                                 + " To analyse it as it is, pass allow_uncalibrated=True.")
        if not self.analysis.quantized:
            raise QuantLensError(
                f"QuantAnalysis('{self.analysis_type.value}'): analysis_model is a float model (no fake quants). "
                "Expected the model returned by quantlens.quantization.prepare (calibration/QAT) as analysis_model "
                "and the float model as baseline_model."
            )
        if self.analysis_type is AnalysisType.PRE_EXPORT and not self.baseline.quantized:
            raise QuantLensError(
                "QuantAnalysis('pre_export'): baseline_model must be the QAT (or calibration) model returned by "
                "prepare, and analysis_model its pre_export copy; got a float baseline."
            )
        if not self.analysis_type.deployed:
            check_weights_correspond(self.baseline, self.analysis, self.analysis_type)
        self.out_dir = Path(out_dir)
        problem = writable_dir_problem(self.out_dir)  # before any model runs, not after a dataset's worth
        if problem is not None:
            raise QuantLensError(f"QuantAnalysis: out_dir cannot hold the reports: {problem}. Pass out_dir= a "
                                 "writable folder (it is created when missing).")
        self.post_process = PostProcess(post_process)
        self.progress = progress
        self._has_bad_case = False
        self._bad_case: Any = None
        self._baseline_case: Any = None
        self.bad_case_result: BadCaseResult | None = None
        #: the traces compare_per_layer() reads: run()'s folders, or set_model_profiler_dir()'s
        self._base_dir, self._analy_dir = self.out_dir / BASELINE_DIR, self.out_dir / ANALYSIS_DIR
        self._row_stream: RowStream | None = None  # the rows the last analysis run computed (row_stream)
        self._readers: dict[Path, TraceReader] = {}  # folder -> the reader run() opened on its trace
        self._traced = False  # whether this QuantAnalysis traced the analysis trace it compares (run())

    # -- bad case ---------------------------------------------------------------------------------------------
    def auto_find_bad_case(self, data_generator: Iterable[Any], num_steps: int | None = None, metric: str = "L1",
                           custom_metric_func=None, custom_metric_order_seq: str | None = None, *,
                           topk: int = 1) -> BadCaseResult:
        """Run both models over ``data_generator`` (each item: one call's inputs, like ``prepare``'s
        example_inputs) and keep the worst sample per output and metric. Writes ``badcase.txt``,
        ``all_badcase_info.pt`` and ``badcase.pt``; the worst sample under ``metric`` (or under the custom
        metric, when given) becomes the bad case for :meth:`run`.

        ``custom_metric_func(baseline, analysis) -> float`` gets float64 tensors; ``custom_metric_order_seq``
        is ``"descending"`` (larger is worse) or ``"ascending"`` (smaller is worse).

        ``topk=k`` keeps the k worst samples per output and metric (``BadCaseResult.topk``/``overall_topk``, also
        in ``badcase.txt`` and ``all_badcase_info.pt``); ``set_bad_case(rank=r)`` then picks the r-th worst.
        """
        check_writable(self.out_dir, "auto_find_bad_case")  # before the search, not after a dataset's worth
        with loop_threads():  # quantlens._threads: few intra-op threads on small or busy machines
            result = find_bad_case(self.baseline, self.analysis, data_generator, self.post_process, num_steps,
                                   metric, custom_metric_func, custom_metric_order_seq, self.progress, topk)
        self.bad_case_result = result
        with FolderLock(self.out_dir, wait=5.0):  # another process's run here keeps its bad case files
            write_bad_case(result, self.out_dir / BAD_CASE_TEXT)
            save_pt({"worst_index": result.worst_index, "worst_value": result.worst_value, "overall": result.overall,
                     "metric": result.metric, "inputs": result.inputs, "topk": result.k, "topk_index": result.topk,
                     "overall_topk": result.overall_topk}, self.out_dir / ALL_BAD_CASE_FILE)
            self.set_bad_case(result.bad_case)
        return result

    _NO_DATA = object()

    def set_bad_case(self, data: Any = _NO_DATA, *, rank: int | None = None, metric: str | None = None,
                     output: str | None = None) -> None:
        """Use ``data`` (one call's inputs: a tuple is positional arguments) for :meth:`run` and
        :meth:`sensitivity`; also saved to ``out_dir/badcase.pt``.

        Or, after ``auto_find_bad_case(..., topk=k)``, ``rank=r`` (1 = the worst) picks the r-th worst sample
        under ``metric`` (default: the search's metric), over all outputs or for one ``output``."""
        if rank is None:
            if data is self._NO_DATA:
                raise QuantLensError("set_bad_case(): pass the inputs (set_bad_case(example_inputs)) or, after "
                                     "auto_find_bad_case(data, topk=k), a rank (set_bad_case(rank=2)).")
            if metric is not None or output is not None:
                raise QuantLensError("set_bad_case(): metric= and output= choose a ranked sample; pass rank= too.")
        else:
            if data is not self._NO_DATA:
                raise QuantLensError("set_bad_case(): pass either the inputs or rank=, not both.")
            if self.bad_case_result is None:
                raise QuantLensError("set_bad_case(rank=...): no bad case search in this QuantAnalysis yet; call "
                                     "auto_find_bad_case(data, topk=k) first (or pass the inputs).")
            data = self.bad_case_result.inputs[self.bad_case_result.ranked(rank, metric, output)]
        refuse_empty(data)
        check_bad_case_shapes((self.analysis, self.baseline), data, "set_bad_case()")
        check_writable(self.out_dir, "set_bad_case()")
        with FolderLock(self.out_dir, wait=5.0):  # (waits for a moment's write: every rank of a sharded run)
            save_pt(data, self.out_dir / BAD_CASE_FILE)
        self._bad_case, self._has_bad_case = data, True

    def save_bad_case(self, filename: str | os.PathLike | None = None) -> Path:
        return save_pt(self._require_bad_case(), Path(filename) if filename else self.out_dir / BAD_CASE_FILE)

    def load_bad_case(self, filename: str | os.PathLike | None = None) -> Any:
        """Load a bad case saved by :meth:`set_bad_case` / :meth:`auto_find_bad_case` (default
        ``out_dir/badcase.pt``) and use it."""
        data = read_bad_case(Path(filename) if filename else self.out_dir / BAD_CASE_FILE)
        self._bad_case, self._has_bad_case = data, True
        return data

    @property
    def bad_case(self) -> Any:
        return self._require_bad_case()

    def _require_bad_case(self) -> Any:
        if not self._has_bad_case:
            raise QuantLensError(
                "QuantAnalysis has no bad case yet. Call auto_find_bad_case(data), set_bad_case(example_inputs) or "
                "load_bad_case() before run() and sensitivity()."
            )
        return self._bad_case

    # -- traces made earlier -------------------------------------------------------------------------------------
    def set_model_profiler_dir(self, baseline_model_profiler_dir: str | os.PathLike,
                               analysis_model_profiler_dir: str | os.PathLike) -> None:
        """Compare traces made earlier by :meth:`run` (possibly by another QuantAnalysis, in another process)
        without running the models: :meth:`compare_per_layer` and :meth:`advise` read the baseline trace from
        ``baseline_model_profiler_dir`` and the analysis trace from ``analysis_model_profiler_dir`` (the
        ``baseline_model/`` and ``analysis_model/`` folders of that run's ``out_dir``). Both are checked now:
        a folder without a complete trace, a trace of the other model or of a model other than this
        QuantAnalysis' (its fingerprint), or two traces of different bad cases raise a ``QuantLensError`` naming
        the folder. A later :meth:`run` writes to this ``out_dir`` again and reads
        from there."""
        base_dir, analy_dir = Path(baseline_model_profiler_dir), Path(analysis_model_profiler_dir)
        base, analy = self._open_traces(base_dir, analy_dir)
        check_made_from(base, self.baseline, base_dir)
        check_made_from(analy, self.analysis, analy_dir)
        self._base_dir, self._analy_dir = base_dir, analy_dir

    def _open_traces(self, base_dir: Path | None = None, analy_dir: Path | None = None
                     ) -> tuple[TraceReader, TraceReader]:
        """The baseline and analysis traces compare_per_layer() reads, checked to belong together."""
        return open_trace_pair(self._readers, self._base_dir if base_dir is None else base_dir,
                               self._analy_dir if analy_dir is None else analy_dir,
                               input_digest(self._bad_case) if self._has_bad_case else None, TraceReader)

    # -- run -------------------------------------------------------------------------------------------------
    def run(self, run_baseline_model: bool = True, run_analysis_model: bool = True) -> RunResult:
        """Trace both models on the bad case: every op site's inputs, outputs, weights and scales stream to
        ``out_dir/baseline_model/`` and ``out_dir/analysis_model/`` (plus ``statistic.txt`` each). The analysis
        run also computes each op's same-input output from the baseline trace, so the baseline runs first (or
        was traced by an earlier call)."""
        check_bad_case_shapes((self.analysis, self.baseline), self._require_bad_case(), "run()")
        check_writable(self.out_dir, "run()")  # before any forward
        # one run per out_dir at a time (trace.folder_lock): two would clear each other's files and mix their traces
        with FolderLock(self.out_dir), loop_threads():  # loop_threads: few intra-op threads on busy machines
            return self._run(run_baseline_model, run_analysis_model)

    def _run(self, run_baseline_model: bool, run_analysis_model: bool) -> RunResult:
        base_dir = self.out_dir / BASELINE_DIR if run_baseline_model else self._base_dir
        analy_dir = self.out_dir / ANALYSIS_DIR
        base = analy = None
        outputs: list[str] = []
        if run_baseline_model:
            # traced together with the analysis: the values only the analysis model's fused ops hold are not kept
            internal = self.analysis.group_internal_sites() if run_analysis_model else frozenset()
            base, outputs = trace_model(self, self.baseline, base_dir, values_not_needed=internal,  # (values held for:)
                                        hold_bytes=HOLD_BYTES if run_analysis_model else 0)  # (the analysis run)
            case = self._require_bad_case()  # the float baseline as the user runs it (eager_check): two forwards
            self._eager_cache = (input_digest(case), check_baseline(self.baseline, case))
            self._base_dir = base_dir
        if run_analysis_model:
            source = base if base is not None else TraceReader(base_dir)
            if base is None:
                check_made_from(source, self.baseline, base_dir)
            if source.input_digest != input_digest(self._require_bad_case()):
                raise QuantLensError(
                    f"The baseline trace in {base_dir} was made on another bad case than the current one, so it "
                    "cannot feed the analysis model's same-input run. Run both models: qa.run()."
                )
            analy, outputs = trace_model(self, self.analysis, analy_dir, same_input=source)
            self._traced = True
            source.drop_held()  # (the row stream keeps the reader)
            self._readers[Path(base_dir)] = source
            self._analy_dir = analy_dir
            check_site_match(source, analy, strict=not self.analysis_type.deployed)
        return RunResult(base_dir if base else None, analy_dir if analy else None,
                         len(base.sites) if base else None, len(analy.sites) if analy else None, outputs,
                         self.consistency)

    @property
    def consistency(self) -> ConsistencyInfo | None:
        """The consistency level the compared models were built with (``ConsistencyStrategy``): the analysis
        model's (a prepared model's state, an IR's meta), else the baseline's (an ONNX analysis model does not
        record it); None when neither model has one (float models)."""
        return ConsistencyInfo.of_pair(self.baseline, self.analysis)

    # -- analysis --------------------------------------------------------------------------------------------
    def compare_per_layer(self, prefixes: Iterable[str] | str | None = None,
                          types: Iterable | str | None = None) -> LayerComparison:
        """Per-op comparison of the traces written by :meth:`run` (see :mod:`.compare`).

        ``prefixes`` keeps op sites whose name starts with one of them; ``types`` keeps op types (``"conv2d"``)
        or module classes (``"Conv2d"`` or ``nn.Conv2d``). Writes ``compare_per_layer_out.txt``/``.csv``,
        ``profiler.html`` and ``abnormal_layer_advisor.txt``; returns the rows.
        """
        traces = self._open_traces()
        stream = self._row_stream
        comparison = compare_traces(*traces, prefixes, types, deployed=self.analysis_type.deployed,
                                    early=stream.rows_for(*traces) if stream is not None else None)
        comparison.consistency = self.consistency
        # traces made earlier (not by this run()): what the analysis that made them knew and the traces do not
        # hold (the reach, its sensitivity ranking), saved with them for these very traces (pair_facts)
        facts = self._facts(traces)
        reach = self._reach(facts)
        comparison = mark(comparison, reach)
        self._last_comparison = comparison
        sensitivity = getattr(self, "_last_sensitivity", None)
        if sensitivity is None and facts is not None:
            sensitivity = facts.sensitivity
        whole = prefixes is None and types is None
        with keeping(comparison):  # a full disk: DiskFullError.result holds the rows
            findings = self.advise(comparison)
            write_comparison(comparison, findings, self.out_dir, sensitivity, traces if whole else None)
            if whole:  # every input of the reports that is not in the traces, for whoever renders them again
                save_facts(PairFacts(self.analysis_type.value, self.analysis.fake_quant_state, self.consistency,
                                     self._last_bias, reach, sensitivity, self._last_eager),
                           self.out_dir / FACTS_FILE, *traces)
        return comparison

    def advise(self, comparison: LayerComparison | None = None) -> list[Finding]:
        """Run the abnormal-layer rules on ``comparison`` (default: a fresh comparison of the traces) and
        write ``abnormal_layer_advisor.txt``."""
        if comparison is None:
            traces = self._open_traces()
            comparison = compare_traces(*traces, deployed=self.analysis_type.deployed)
            comparison.consistency = self.consistency
            comparison = mark(comparison, self._reach(self._facts(traces)))
        from quantlens.profiler.bias_check import bias_saturation

        analysed = getattr(self.analysis, "model", None) or getattr(self.analysis, "module", None)
        comparison = reached_only(comparison)  # an op no compared output depends on explains nothing
        self._last_bias = bias_saturation(analysed, comparison)
        self._last_eager = self._eager()
        ctx = AdvisorContext(comparison, self.analysis_type.value, self.analysis.fake_quant_state,
                             self.consistency, bias=self._last_bias, eager=self._last_eager)
        findings = advise(ctx)
        write_advisor(findings, self.out_dir / ADVISOR_FILE, self.consistency)
        return findings

    def _eager(self):
        """Where the float baseline as the user runs it parts from its traced forward (:mod:`.eager_check`), as
        :meth:`run` found it on the bad case it traced; for traces made earlier, what their analysis saved."""
        cached = getattr(self, "_eager_cache", None)
        if cached is not None and self._has_bad_case and cached[0] == input_digest(self._bad_case):
            return cached[1]
        facts = None if self._traced else self._facts(self._open_traces())
        return facts.eager if facts is not None else None

    def _facts(self, traces: tuple[TraceReader, TraceReader]) -> PairFacts | None:
        """The facts saved with ``traces`` by the analysis that made them; None for traces this run() made."""
        return None if self._traced else find_facts(self.out_dir, *traces)

    def _reach(self, facts: PairFacts | None = None) -> SiteReach:
        """Which op sites reach a compared output and which are host-side, on the bad case (:mod:`.reach`): from
        the analysis model when it has the structure (a prepared model, an IR), else the baseline; one forward,
        cached per bad case. Without a bad case (traces compared from folders): what the analysis that made the
        traces saved with them (``facts``), else nothing is claimed."""
        if not self._has_bad_case:
            return facts.reach if facts is not None and facts.reach is not None else SiteReach(None, frozenset())
        case = self._sensitivity_case()
        key = input_digest(case)
        cached = getattr(self, "_reach_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        reach = site_reach(self._reach_access(), case)
        self._reach_cache = (key, reach)
        return reach

    def _reach_access(self):
        """The model whose data flow says which sites reach an output: the analysis model when it has the structure
        (a prepared model, an IR), else the baseline."""
        structured = [a for a in (self.analysis, self.baseline)
                      if getattr(a, "prepared", False) or hasattr(a, "module")]
        return structured[0] if structured else self.baseline

    def _sensitivity_case(self) -> Any:
        """The bad case for sensitivity, in a format both models take: the baseline's traced format when the
        current bad case holds the same tensors in another format (an IR's deployment format)."""
        current = self._require_bad_case()
        traced = getattr(self, "_baseline_case", None)
        if traced is not None and input_digest(traced) == input_digest(current):
            return traced
        return current

    def _save_sensitivity(self, result: SensitivityResult) -> None:
        """Keep the ranking the per-layer text now leads with in the traces' facts (pair_facts)."""
        try:
            traces = self._open_traces()
        except QuantLensError:  # the traces are gone or of another bad case: the ranking is not theirs
            return
        with_sensitivity(self.out_dir, *traces, result, input_digest(self._sensitivity_case()))

    def _refuse_onnxruntime(self, what: str) -> None:
        if self.analysis_type is AnalysisType.ONNXRUNTIME:
            raise QuantLensError(
                f"{what}() is not offered for 'onnxruntime': onnxruntime runs the whole graph, so one op site "
                "cannot be switched on its own. Rank the integer ops with QuantAnalysis(qat_ir, quantized_ir, "
                f"'convert').{what}().")

    def joint_sensitivity(self, metric: str = "L1", pairs: int = 6,
                          share_threshold: float = 0.5) -> JointSensitivityResult:
        """Rank one quantizer at a time (``sensitivity()``'s rows), one op at a time (every quantizer the op's
        integer kernel depends on, so its int32 bias is quantized as deployed) and pairs of the top ``pairs``
        rows of both rankings (with their interaction), and say how much of the model's error the top rows
        explain: ``warning`` when the best single row explains less than ``share_threshold`` of it
        (:mod:`.joint_sensitivity`). Writes ``output_<name>_<metric>_joint_sensitivity.txt``/``.pt`` per output.
        One process (no sharding)."""
        self._refuse_onnxruntime("joint_sensitivity")
        with loop_threads():
            result = run_joint_sensitivity(self.baseline, self.analysis, self.analysis_type, self._sensitivity_case(),
                                           self.post_process, metric, pairs, share_threshold, self.progress)
        for table in result:
            write_joint_sensitivity(table, self.out_dir)
        return result

    def sensitivity(self, metric: str = "L1", reverse: bool = False, shard: bool | None = None) -> SensitivityResult:
        """Rank the analysis model's quantizers by their effect on each output, most sensitive first
        (``reverse=True``: least sensitive first). Writes ``output_<name>_<metric>_sensitive_ops.txt``/``.pt``
        per output. The result feeds ``sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter``.

        ``shard`` (default: whether ``torch.distributed`` is initialised): split the quantizers over the ranks
        and record each finished one in ``out_dir/sensitivity_progress/`` so an interrupted run resumes
        (:mod:`.sharding`); every rank returns the same result, rank 0 writes the files."""
        self._refuse_onnxruntime("sensitivity")
        from quantlens.profiler.sharding import dist_rank_world, run_sharded_sensitivity

        group = dist_rank_world()
        if shard is None:
            shard = group is not None
        with loop_threads():  # quantlens._threads: few intra-op threads on small or busy machines
            if not shard:
                result = run_sensitivity(self.baseline, self.analysis, self.analysis_type, self._sensitivity_case(),
                                         self.post_process, metric, reverse, self.progress)
            else:
                result = run_sharded_sensitivity(self.baseline, self.analysis, self.analysis_type,
                                                 self._sensitivity_case(), self.post_process, self.out_dir, metric,
                                                 reverse, self.progress)
        if not (shard and group is not None and group[0] != 0):  # sharded: rank 0 writes the report files
            self._last_sensitivity = result
            comparison = getattr(self, "_last_comparison", None)
            with keeping(result):  # a full disk: DiskFullError.result holds the tables
                for table in result:
                    write_sensitivity(table, self.out_dir)
                if comparison is not None and not reverse:  # its summary leads with the sensitivity ranking
                    write_compare_text(comparison, self.out_dir / COMPARE_TEXT, sensitivity=result)
                    self._save_sensitivity(result)
        if shard and group is not None:
            import torch.distributed as dist

            dist.barrier()  # every rank returns once the files are written
        return result
