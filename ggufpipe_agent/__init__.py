"""ggufpipe stage agent: runs one contiguous layer range of a GGUF model.

This package is the leaf that ships to GPU hosts. It never imports
``ggufpipe_tui`` or Textual; the orchestrator imports the protocol from here.
"""

from __future__ import annotations

__version__ = "0.1.0"
#: What an agent that cannot run on its host starts its last stderr line with
#: (ggufpipe_agent/selfcheck.py); the orchestrator looks for it.
UNFIT_MARKER = "ggufpipe-agent cannot run here:"

#: Bumped whenever a control message or the object record layout changes in a
#: way an older peer cannot read. The orchestrator refuses a mismatched agent.
#: 2: ModelFacts.memory; 3: Tokenize.messages; 4: listen key, heartbeats;
#: 5: model delivery (deliverywire), ModelInfo.identity, ProvisionStage.stage_file, cache requests;
#: 6: positions in the object header, prefix reuse in ProvisionStage (reuse) and StageReady (held);
#: 7: direct links (link_messages), ProvisionStage.ring, StageFault.link_peer.
#: 8: Refused.run_id.
#: 9: shared agent processes (Hello.share_endpoint, Hello.share_token, ShareAttach) and
#:    ggufpipe-agent receive (a stage file over SSH on its own exec session).
#: 10: sampling fields, logprobs on the token-out edge, tools in Tokenize.
#: 11: object header flags (a prompt in parts, MORE), EngineOptions.batching, LinkDown.token
#:     (a link re-made after it broke: docs/recovery.md).
#: 12: replay in proportion (object flag REBUILD, PrefixOffer.resume/resend,
#:     PrefixHeld.sent, SamplingParams.skip_draws: docs/recovery.md).
PROTOCOL_VERSION = 12
