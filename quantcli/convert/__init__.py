"""`quantcli convert`: stream a safetensors checkpoint into a quantized one.

Data flow: plan from headers (quantcli/planning/, `plan_conversion`) -> passes (passes/: fact
passes learn facts about modules, such as each fused group's shared amax; a weight pass, if one
takes any tensor, stages quantized tensors layer by layer) -> the per-shard job
(shard.py: read -> quantize, or a staged product as it is -> layout names -> streamed into a
shard of the staging folder `DST.partial`; returns a ShardResult, no shared state) -> finalize
(finalize.py: index, configs, copied files, model card, manifest last) -> the staging folder is
renamed to DST (destination.py). job.py runs these in order; progress.py records each finished shard's
result so --resume continues an interrupted run and yields the same bytes.

Nothing is lost or half-written (issue 10): every destination problem is refused before any
work (`check_destination`); one run at a time holds the staging folder (`StagingLock`); the
progress file records what each source shard was (size, mtime, sampled hash) so --resume never
reuses shards made from other bytes; a filesystem fault keeps the staging folder for --resume,
a data refusal in a fresh run removes it; the old DST is only set aside, never deleted, until
the new one is in place.
"""

from quantcli.convert.destination import FilesystemError, check_destination, staging_dir
from quantcli.convert.device import check_run_options, resolve_device
from quantcli.convert.job import ConversionJob, convert
from quantcli.convert.lock import LOCK_NAME, StagingLock
from quantcli.convert.passes import learn_facts
from quantcli.convert.progress import PROGRESS_NAME, fingerprint
from quantcli.convert.records import ConvertResult, Findings, RunOptions, ShardResult
from quantcli.convert.shard import convert_shard

__all__ = ["LOCK_NAME", "PROGRESS_NAME", "ConversionJob", "ConvertResult", "FilesystemError", "Findings",
           "RunOptions", "ShardResult", "StagingLock", "check_destination", "check_run_options", "convert",
           "convert_shard", "fingerprint", "learn_facts", "resolve_device", "staging_dir"]
