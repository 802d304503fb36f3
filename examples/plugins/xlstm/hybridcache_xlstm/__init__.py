"""xLSTM as a hybridcache plugin: the `mlstm` cache type (state.py) and the `xlstm` family (model.py)."""

from hybridcache_xlstm.model import XLSTMLM, XLSTMConfig
from hybridcache_xlstm.state import MLSTMSpec, MLSTMStateLayer, mlstm_step

__all__ = ["MLSTMSpec", "MLSTMStateLayer", "XLSTMConfig", "XLSTMLM", "mlstm_step"]
