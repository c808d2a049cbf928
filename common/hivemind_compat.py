"""The names the core has always imported from here; the patch layer itself is :mod:`common.hivemind_patches`
(``install``, its bug fixes and our policies, with the patch table in ``common/README.md``)."""

from common.hivemind_patches import (
    PATCH_SET_VERSION,
    PINNED_VERSION,
    install,
    require_installed,
    require_pinned_hivemind,
    software_fingerprint,
)
from common.hivemind_patches.fixes import (
    StreamCutShort,
    client_mode_argument,
    grad_buffers_for_scaler,
    skip_nonfinite_steps,
)
from common.hivemind_patches.policies import (
    ENDED_AVERAGER,
    GROUPLESS_ROUND,
    bound_state_downloads,
    catch_up_one_step_behind,
    count_state_reloads,
    gradient_rounds_start_at_the_update,
    restart_throughput_timer,
    rsa_private_key_from_der,
    sign_with_identity_key,
)

__all__ = [
    "ENDED_AVERAGER",
    "GROUPLESS_ROUND",
    "PATCH_SET_VERSION",
    "PINNED_VERSION",
    "StreamCutShort",
    "bound_state_downloads",
    "catch_up_one_step_behind",
    "client_mode_argument",
    "count_state_reloads",
    "grad_buffers_for_scaler",
    "gradient_rounds_start_at_the_update",
    "install",
    "require_installed",
    "require_pinned_hivemind",
    "restart_throughput_timer",
    "rsa_private_key_from_der",
    "sign_with_identity_key",
    "skip_nonfinite_steps",
    "software_fingerprint",
]
