import sys
from specpilot.bench.tlv import _calibration
from specpilot.spec.calibration import save_calibration
cal = _calibration("cpu")
cal.cost = None
print(save_calibration(cal, sys.argv[1]))
