"""Ray's GCP node provider, with the label cache kept current: the cluster file's provider.

Ray 2.60's v2 autoscaler (what `ray up` starts on the head since Ray 2.50) checks, after a new
worker's setup, that the worker's status label says "up-to-date"; it reads the label through the
provider's node cache (``node_tags``), which ``set_node_tags`` refreshes just before it writes the
label and not after. So the check sees "setting-up", calls the setup failed and runs it again, and
that second setup's ``ray stop`` ends the Ray node that had joined: the worker VM is deleted and
another one launched, again and again (``launcher cluster rehearse --up --worker`` with Ray's own
provider: 3 worker inserts for one worker; with this one: 1). Here the cached node takes the labels
written, so the check reads what was set. Everything else is Ray's provider as it is.

The cluster file names it as an external provider (``type: external``, ``module:
cluster.gcp_provider.Provider``, :data:`cluster.config.PROVIDER_MODULE`) beside the GCP fields Ray's
provider reads; the head imports it from the launcher installed in its venv. Importing it imports
Ray's GCP provider, hence the Google API client (the cluster extra).
"""

from __future__ import annotations

from launcher import _ray


class Provider(_ray.resolve("GCPNodeProvider")):
    def set_node_tags(self, node_id: str, tags: dict):
        result = super().set_node_tags(node_id, tags)
        with self.lock:
            node = self.cached_nodes.get(node_id)
            if node is not None:
                node["labels"] = {**(node.get("labels") or {}), **tags}
        return result

