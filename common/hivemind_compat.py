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
    HOLDERS_GONE_AFTER_SECONDS,
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
    "HOLDERS_GONE_AFTER_SECONDS",
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
    "keep_inbound_stream_handlers_alive",
    "read_8bit_tensors_with_numpy_2",
    "require_installed",
    "require_pinned_hivemind",
    "restart_throughput_timer",
    "rsa_private_key_from_der",
    "sign_with_identity_key",
    "silence_schedule_fast_forward_warning",
    "skip_nonfinite_steps",
    "software_fingerprint",
    "stream_results_to_zero_share_full_peers",
]

# common/optimizer.py still calls these four by name (before its averagers are forked); each now means "every
# process-wide patch", which start_dht has usually installed already (then a call does nothing)
keep_inbound_stream_handlers_alive = read_8bit_tensors_with_numpy_2 = install
silence_schedule_fast_forward_warning = stream_results_to_zero_share_full_peers = install
