//! Envoy metadata in and out: the subset hint, the served endpoint, the pick.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

use super::{
    DESTINATION_METADATA_KEY, LB_METADATA_NAMESPACE, SERVED_METADATA_KEY, SUBSET_METADATA_KEY,
    SUBSET_METADATA_NAMESPACE,
};

fn lookup<'a>(metadata: Option<&'a Metadata>, namespace: &str, key: &str) -> Option<&'a Kind> {
    metadata?
        .filter_metadata
        .get(namespace)?
        .fields
        .get(key)?
        .kind
        .as_ref()
}

/// The subset hint, when the data plane sent one: `None` when absent (or `null`), else the
/// entries that are a bare IP or `ip:port`, from a list of strings or one comma-joined string.
/// Entries that are neither are dropped, so a hint made only of those allows no endpoint.
pub(super) fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let mut out = Vec::new();
    match lookup(metadata, SUBSET_METADATA_NAMESPACE, SUBSET_METADATA_KEY)? {
        Kind::NullValue(_) => return None,
        Kind::StringValue(s) => push_entries(s, &mut out),
        Kind::ListValue(list) => {
            for v in &list.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    push_entries(s, &mut out);
                } else {
                    tracing::debug!(entry = ?v, "subset hint entry is not a string; ignored");
                }
            }
        }
        other => tracing::debug!(hint = ?other, "subset hint is neither a list nor a string"),
    }
    Some(out)
}

fn push_entries(s: &str, out: &mut Vec<String>) {
    for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        match normalize_entry(entry) {
            Some(e) if !out.contains(&e) => out.push(e),
            Some(_) => {}
            None => tracing::debug!(entry, "subset hint entry is not an IP or ip:port; ignored"),
        }
    }
}

/// `ip:port` stays `ip:port`, a bare IP (`10.0.0.1`, `::1`, `[::1]`) stays a bare IP.
fn normalize_entry(entry: &str) -> Option<String> {
    if let Ok(addr) = entry.parse::<SocketAddr>() {
        return Some(addr.to_string());
    }
    let bare = entry
        .strip_prefix('[')
        .and_then(|e| e.strip_suffix(']'))
        .unwrap_or(entry);
    bare.parse::<IpAddr>().ok().map(|ip| ip.to_string())
}

/// The endpoint that served the request, as the data plane reports it on the response path.
pub(super) fn served_endpoint(metadata: Option<&Metadata>) -> Option<String> {
    match lookup(metadata, LB_METADATA_NAMESPACE, SERVED_METADATA_KEY)? {
        Kind::StringValue(s) if !s.trim().is_empty() => Some(s.trim().to_owned()),
        _ => None,
    }
}

/// Dynamic metadata `{"envoy.lb": {"x-gateway-destination-endpoint": endpoints}}`.
pub(super) fn destination(endpoints: &str) -> Struct {
    let inner = Struct {
        fields: HashMap::from([(
            DESTINATION_METADATA_KEY.to_owned(),
            Value {
                kind: Some(Kind::StringValue(endpoints.to_owned())),
            },
        )]),
    };
    Struct {
        fields: HashMap::from([(
            LB_METADATA_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]),
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::ListValue;

    pub(crate) fn with(namespace: &str, key: &str, kind: Kind) -> Metadata {
        Metadata {
            filter_metadata: HashMap::from([(
                namespace.to_owned(),
                Struct {
                    fields: HashMap::from([(key.to_owned(), Value { kind: Some(kind) })]),
                },
            )]),
            ..Default::default()
        }
    }

    fn subset(kind: Kind) -> Option<Vec<String>> {
        subset_hint(Some(&with(
            SUBSET_METADATA_NAMESPACE,
            SUBSET_METADATA_KEY,
            kind,
        )))
    }

    fn list(items: &[&str]) -> Kind {
        Kind::ListValue(ListValue {
            values: items
                .iter()
                .map(|s| Value {
                    kind: Some(Kind::StringValue((*s).to_owned())),
                })
                .collect(),
        })
    }

    #[test]
    fn subset_forms() {
        assert_eq!(subset_hint(None), None);
        assert_eq!(subset(Kind::NullValue(0)), None);
        assert_eq!(
            subset(list(&["10.0.0.1:8000", "10.0.0.2"])),
            Some(vec!["10.0.0.1:8000".into(), "10.0.0.2".into()])
        );
        assert_eq!(
            subset(Kind::StringValue(" 10.0.0.1:8000, 10.0.0.2 ,,".into())),
            Some(vec!["10.0.0.1:8000".into(), "10.0.0.2".into()])
        );
        assert_eq!(
            subset(list(&[
                "[::1]:8000",
                "[fd00::2]",
                "fd00::3",
                "10.0.0.1:8000"
            ])),
            Some(vec![
                "[::1]:8000".into(),
                "fd00::2".into(),
                "fd00::3".into(),
                "10.0.0.1:8000".into()
            ])
        );
    }

    #[test]
    fn empty_or_invalid_subset_allows_nothing() {
        assert_eq!(subset(list(&[])), Some(vec![]));
        assert_eq!(subset(Kind::StringValue(String::new())), Some(vec![]));
        assert_eq!(subset(list(&["pod-a", "10.0.0.1:port"])), Some(vec![]));
        assert_eq!(subset(Kind::BoolValue(true)), Some(vec![]));
    }

    #[test]
    fn served_endpoint_is_read_from_envoy_lb() {
        let m = with(
            LB_METADATA_NAMESPACE,
            SERVED_METADATA_KEY,
            Kind::StringValue("10.0.0.1:8000".into()),
        );
        assert_eq!(served_endpoint(Some(&m)).as_deref(), Some("10.0.0.1:8000"));
        assert_eq!(served_endpoint(None), None);
    }

    #[test]
    fn destination_metadata_shape() {
        let s = destination("10.0.0.1:8000,10.0.0.2:8000");
        let Some(Kind::StructValue(inner)) = &s.fields["envoy.lb"].kind else {
            panic!("envoy.lb is not a struct: {s:?}");
        };
        assert_eq!(
            inner.fields["x-gateway-destination-endpoint"].kind,
            Some(Kind::StringValue("10.0.0.1:8000,10.0.0.2:8000".into()))
        );
    }
}
