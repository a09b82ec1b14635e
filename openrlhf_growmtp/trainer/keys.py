"""Names under which a sample's GrowMTP data rides through upstream's response dicts and Experience.info."""

RECORD_KEY = "growmtp_record"  # the packed SequenceRecord of the sample
REQUEST_KEY = "growmtp_request"  # the id of the request it was captured for (names a record that does not decode)
ACCEPTED_KEY = "growmtp_accepted"  # its per-cycle accepted counts (the controller's rollout metrics)
DROPPED_KEY = "growmtp_dropped"  # cycles vLLM verified that its record leaves out (not K samples of q)
CHECKED_KEY = "growmtp_checked"  # 1 when its accepted counts were compared with vLLM's own, step by step
RECORD_INDEX_KEY = "growmtp_record_index"  # trainer side: the sample's record among its RL step's records
RECORD_SECONDS_KEY = "growmtp_record_s"  # response only: the rollout actor's seconds on its records, per response
