"""The bicache policy: the r -> safe-depth profile, one depth policy object per mode, the online
audit, and the planner that makes the whole depth decision for a request."""

from .planner import MatchFacts, RequestFacts, ReusePlan, plan_reuse
from .policy import DepthPolicy, make_policy
from .profile import BicacheProfile, find_profile

__all__ = ["BicacheProfile", "DepthPolicy", "MatchFacts", "RequestFacts", "ReusePlan", "find_profile", "make_policy",
           "plan_reuse"]
