"""The bicache policy: the r -> safe-depth profile, depth choice per request, and calibration."""

from .policy import DepthChoice, choose_depth
from .profile import BicacheProfile, find_profile

__all__ = ["BicacheProfile", "DepthChoice", "choose_depth", "find_profile"]
