"""The multi-chip partitioner: an RL policy proposes, a constraint solver repairs.

Place the operations of a computation graph onto a chain or a ring of chiplets
(or the devices of a pipeline) for the highest throughput. Every method
returns only valid partitions, because every candidate goes through the same
repair (an LP, then CP-SAT). A bare chiplet count means ``Chiplets.default_for``
the graph, and ``method="rl"`` fine-tunes the better (on this graph) of the two
pre-trained policies shipped with atoll (``Policy.pretrained_set()``). The
policies train on ``synthetic_cases`` only; the held-out architectures in
``_heldout.py`` test them. See ``docs/partition.md``
for the constraints, the cost model and the methods.

>>> from atoll.partition import bert_graph, search
>>> part = search(bert_graph(), 4, method="dp")  # doctest: +SKIP
"""

from ._baselines import Tracker as Tracker
from ._cost import Partition as Partition
from ._cost import Stage as Stage
from ._cost import evaluate as evaluate
from ._cost import is_valid as is_valid
from ._cost import stage_times as stage_times
from ._cost import throughput as throughput
from ._cost import violations as violations
from ._dp import dp_split as dp_split
from ._errors import GraphError as GraphError
from ._errors import InfeasibleError as InfeasibleError
from ._errors import RepairTimeout as RepairTimeout
from ._graph import Edge as Edge
from ._graph import Op as Op
from ._graph import OpGraph as OpGraph
from ._graph import load_graph as load_graph
from ._graph import save_graph as save_graph
from ._hardware import Chiplets as Chiplets
from ._jaxpr import from_jax as from_jax
from ._models import bert_graph as bert_graph
from ._models import builtin_graph as builtin_graph
from ._models import builtin_names as builtin_names
from ._models import decoder_graph as decoder_graph
from ._plot import plot_curves as plot_curves
from ._plot import plot_partition as plot_partition
from ._policy import Policy as Policy
from ._progress import ProgressBar as ProgressBar
from ._repair import Repairer as Repairer
from ._repair import repair as repair
from ._rl import TrainLog as TrainLog
from ._rl import finetune as finetune
from ._rl import pretrain as pretrain
from ._search import METHODS as METHODS
from ._search import search as search
from ._synthetic import scaled_chiplets as scaled_chiplets
from ._synthetic import synthetic_cases as synthetic_cases

__all__ = [
    "METHODS",
    "Chiplets",
    "Edge",
    "GraphError",
    "InfeasibleError",
    "Op",
    "OpGraph",
    "Partition",
    "Policy",
    "ProgressBar",
    "RepairTimeout",
    "Repairer",
    "Stage",
    "Tracker",
    "TrainLog",
    "bert_graph",
    "builtin_graph",
    "builtin_names",
    "decoder_graph",
    "dp_split",
    "evaluate",
    "finetune",
    "from_jax",
    "is_valid",
    "load_graph",
    "plot_curves",
    "plot_partition",
    "pretrain",
    "repair",
    "save_graph",
    "scaled_chiplets",
    "search",
    "stage_times",
    "synthetic_cases",
    "throughput",
    "violations",
]
