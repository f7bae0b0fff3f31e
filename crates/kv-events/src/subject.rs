//! NATS subjects (DESIGN.md § KV events). Each identity becomes one subject token: `.` becomes
//! `_`, and so do the characters NATS reserves in tokens (`*`, `>`, whitespace), so no
//! identity can add tokens or wildcards. The envelope carries the exact identity.

use std::borrow::Cow;

/// One subject token made from an identity.
pub fn token(identity: &str) -> Cow<'_, str> {
    let bad = |c: char| c == '.' || c == '*' || c == '>' || c.is_whitespace();
    if identity.is_empty() {
        return Cow::Borrowed("_");
    }
    if identity.contains(bad) {
        Cow::Owned(
            identity
                .chars()
                .map(|c| if bad(c) { '_' } else { c })
                .collect(),
        )
    } else {
        Cow::Borrowed(identity)
    }
}

/// `kvgate.kv.<namespace>.<pool>.<pod>`: a pod's KV events.
pub fn kv(namespace: &str, pool: &str, pod: &str) -> String {
    format!(
        "kvgate.kv.{}.{}.{}",
        token(namespace),
        token(pool),
        token(pod)
    )
}

/// `kvgate.kv.<namespace>.<pool>.>`: every pod of a pool.
pub fn kv_pool_wildcard(namespace: &str, pool: &str) -> String {
    format!("kvgate.kv.{}.{}.>", token(namespace), token(pool))
}

/// `kvgate.kvbm.<namespace>.<node>`: a node's KV block manager tiers.
pub fn kvbm(namespace: &str, node: &str) -> String {
    format!("kvgate.kvbm.{}.{}", token(namespace), token(node))
}

/// `kvgate.kvbm.<namespace>.>`: every node.
pub fn kvbm_wildcard(namespace: &str) -> String {
    format!("kvgate.kvbm.{}.>", token(namespace))
}

/// `kvgate.kvbm-peers.<namespace>`: block managers announcing where peers pull their blocks
/// (a token of its own after `kvgate`, so no `kvgate.kvbm.<namespace>.>` subscriber sees it).
pub fn kvbm_peers(namespace: &str) -> String {
    format!("kvgate.kvbm-peers.{}", token(namespace))
}

/// `kvgate.snapshot.<namespace>.<pool>.<pod>`: request/reply for a pod's resident set.
pub fn snapshot(namespace: &str, pool: &str, pod: &str) -> String {
    format!(
        "kvgate.snapshot.{}.{}.{}",
        token(namespace),
        token(pool),
        token(pod)
    )
}

/// `kvgate.snapshot.<namespace>.<node>`: request/reply for a node's KV block manager tiers
/// (one token fewer than a pod's, so the two cannot collide).
pub fn node_snapshot(namespace: &str, node: &str) -> String {
    format!("kvgate.snapshot.{}.{}", token(namespace), token(node))
}

/// `kvgate.load.<namespace>.<pool>.<pod>`: a pod's engine load samples.
pub fn load(namespace: &str, pool: &str, pod: &str) -> String {
    format!(
        "kvgate.load.{}.{}.{}",
        token(namespace),
        token(pool),
        token(pod)
    )
}

/// `kvgate.inflight.<namespace>.<pool>`: in-flight deltas between EPP replicas.
pub fn inflight(namespace: &str, pool: &str) -> String {
    format!("kvgate.inflight.{}.{}", token(namespace), token(pool))
}

/// `kvgate.handoff.<namespace>.<pool>.<replica>` (16 hex digits): response events a peer EPP
/// replica's observer relays to the replica that routed the requests.
pub fn handoff(namespace: &str, pool: &str, replica: u64) -> String {
    format!(
        "kvgate.handoff.{}.{}.{replica:016x}",
        token(namespace),
        token(pool)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_cannot_add_tokens_or_wildcards() {
        assert_eq!(
            kv("default", "llama.70b", "pod-1"),
            "kvgate.kv.default.llama_70b.pod-1"
        );
        assert_eq!(kv("a b", "*", ">"), "kvgate.kv.a_b._._");
        assert_eq!(kv_pool_wildcard("ns", "p"), "kvgate.kv.ns.p.>");
        assert_eq!(kvbm("ns", "node.1"), "kvgate.kvbm.ns.node_1");
        assert_eq!(snapshot("ns", "p", ""), "kvgate.snapshot.ns.p._");
        assert_eq!(load("ns", "p", "x"), "kvgate.load.ns.p.x");
        assert_eq!(inflight("ns", "p"), "kvgate.inflight.ns.p");
        assert_eq!(kvbm_wildcard("ns"), "kvgate.kvbm.ns.>");
        assert_eq!(kvbm_peers("a.b"), "kvgate.kvbm-peers.a_b");
    }
}
