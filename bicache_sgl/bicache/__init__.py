"""The bicache policy: the r -> safe-depth profile and one depth policy object per mode."""

from .policy import DepthChoice, DepthPolicy, make_policy, request_policy
from .profile import BicacheProfile, find_profile

__all__ = ["BicacheProfile", "DepthChoice", "DepthPolicy", "find_profile", "make_policy", "request_policy"]
