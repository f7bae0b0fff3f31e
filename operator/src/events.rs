//! Kubernetes Events (`events.k8s.io/v1`) about the autoscalers.
//!
//! kube-runtime's `Recorder` folds events with the same reason into one series and keeps the
//! first one's note, so "2 → 3 replicas" followed by "3 → 4 replicas" would read as the first
//! twice. An operator's events are its decisions, so here the note is part of the key: the same
//! event again within [`SERIES_WINDOW`] bumps its series count; a different note is a new Event.

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use tokio::sync::Mutex;

/// How long a repeated event extends its series rather than starting a new Event.
pub const SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);
/// The longest note written (the API server refuses more than 1 kB).
const MAX_NOTE: usize = 1000;
/// Series remembered at most (older ones are forgotten first).
const MAX_CACHED: usize = 4096;

/// Normal or Warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Something expected happened.
    Normal,
    /// Something needs a person's attention.
    Warning,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Normal => "Normal",
            Kind::Warning => "Warning",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    namespace: String,
    name: String,
    uid: String,
    kind: Kind,
    reason: String,
    note: String,
}

#[derive(Debug, Clone)]
struct Series {
    event: String,
    count: i32,
    last: Timestamp,
}

/// Writes Events as `reporting_controller`/`reporting_instance`.
pub struct Events {
    client: kube::Client,
    controller: String,
    instance: String,
    series: Mutex<HashMap<Key, Series>>,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events")
            .field("controller", &self.controller)
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

fn bounded(note: &str) -> String {
    if note.len() <= MAX_NOTE {
        return note.to_owned();
    }
    let mut end = MAX_NOTE;
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    note[..end].to_owned()
}

impl Events {
    /// A writer for this replica.
    pub fn new(client: kube::Client, controller: &str, instance: &str) -> Self {
        Self {
            client,
            controller: controller.to_owned(),
            instance: instance.to_owned(),
            series: Mutex::new(HashMap::new()),
        }
    }

    /// Records an event about `regarding` (its namespace holds the Event).
    pub async fn publish(
        &self,
        regarding: &ObjectReference,
        kind: Kind,
        reason: &str,
        action: &str,
        note: &str,
    ) -> Result<(), kube::Error> {
        let namespace = regarding
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let note = bounded(note);
        let key = Key {
            namespace: namespace.clone(),
            name: regarding.name.clone().unwrap_or_default(),
            uid: regarding.uid.clone().unwrap_or_default(),
            kind,
            reason: reason.to_owned(),
            note: note.clone(),
        };
        let api: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        let now = Timestamp::now();
        let mut series = self.series.lock().await;
        let window = i64::try_from(SERIES_WINDOW.as_millis()).unwrap_or(i64::MAX);
        series.retain(|_, s| now.as_millisecond() - s.last.as_millisecond() < window);
        if let Some(s) = series.get_mut(&key) {
            let count = s.count + 1;
            let patch = Event {
                series: Some(EventSeries {
                    count,
                    last_observed_time: MicroTime(now),
                }),
                ..Event::default()
            };
            match api
                .patch(&s.event, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    s.count = count;
                    s.last = now;
                    return Ok(());
                }
                // Expired or deleted: start a new one.
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e),
            }
        }
        let name = format!(
            "{}.{:x}",
            regarding.name.as_deref().unwrap_or(&self.controller),
            now.as_nanosecond()
        );
        let event = Event {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(namespace),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(now)),
            action: Some(action.to_owned()),
            reason: Some(reason.to_owned()),
            note: Some(note),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(kind.as_str().to_owned()),
            ..Event::default()
        };
        api.create(&PostParams::default(), &event).await?;
        if series.len() >= MAX_CACHED
            && let Some(oldest) = series
                .iter()
                .min_by_key(|(_, s)| s.last)
                .map(|(k, _)| k.clone())
        {
            series.remove(&oldest);
        }
        series.insert(
            key,
            Series {
                event: name,
                count: 1,
                last: now,
            },
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_cut_on_a_character_boundary() {
        let long = "é".repeat(600);
        let cut = bounded(&long);
        assert!(cut.len() <= MAX_NOTE);
        assert!(cut.chars().all(|c| c == 'é'));
        assert_eq!(bounded("short"), "short");
    }
}
