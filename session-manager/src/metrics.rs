//! The manager's metrics, served by `ongrid_service::metrics` on `[metrics] listen`.
//!
//! Two kinds: counts read from the store at each scrape ([`crate::exporter::ManagerExporter`]:
//! sessions and jobs by state, GPUs by model, mode, health and use, nodes, the GPUs each
//! reservation that has not ended holds) and events counted where they happen ([`events`]: HTTP requests by route template and status, holds by reason, time from a
//! request to a running container, the scheduler's plan duration and queue). Event handles are
//! process-wide, like a logger, because the places that count them (routes, loops) are spread
//! over modules that share no handle; managers started in one test process share them.
//!
//! Labels are bounded: states, reasons, routes, HTTP methods and statuses are closed sets
//! (a method or status outside them is counted as `other` or by its class), GPU models and modes
//! are the site's few, reservations are the few admins made that have not ended; no DN, user, session
//! or node name is ever a label.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::LazyLock;
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use chrono::{DateTime, Utc};
use ongrid_core::holds::HoldReason;
use ongrid_core::{NodeName, SessionId};
use ongrid_scheduler::Action;
use ongrid_service::metrics::{latency_buckets, wait_buckets};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::domain::sessions::SessionRecord;

/// An HTTP request's labels, each from a closed set whatever the client sends: see
/// [`route_label`], [`method_label`] and [`status_label`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct HttpLabels {
    /// The matched route template (`/v1/sessions/{name}`), `unmatched` for none.
    pub route: String,
    pub method: &'static str,
    pub status: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: String,
    pub method: &'static str,
}

/// The methods counted by name; every other is `other`, so that a client cannot add series by
/// inventing methods (any token is a valid HTTP method).
pub const METHODS: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE",
];

/// The statuses counted by their code: those the manager answers with. Any other is counted by
/// its class (`1xx` to `9xx`), so the set of values is closed by construction.
pub const STATUSES: [u16; 19] = [
    200, 201, 204, 303, 304, 400, 401, 403, 404, 405, 409, 413, 415, 422, 429, 500, 502, 503, 504,
];

/// The route template the router matched, `unmatched` when none did (the router's templates are
/// a closed set; the path as sent never is a label).
pub fn route_label(matched: Option<&MatchedPath>) -> String {
    matched.map_or_else(|| "unmatched".to_owned(), |path| path.as_str().to_owned())
}

/// One of [`METHODS`], or `other`.
pub fn method_label(method: &axum::http::Method) -> &'static str {
    METHODS
        .iter()
        .find(|known| **known == method.as_str())
        .copied()
        .unwrap_or("other")
}

/// One of [`STATUSES`], else the status's class.
pub fn status_label(status: axum::http::StatusCode) -> String {
    let code = status.as_u16();
    if STATUSES.contains(&code) {
        code.to_string()
    } else {
        format!("{}xx", code / 100)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct StateLabels {
    pub state: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct GpuLabels {
    pub model: String,
    /// `exclusive`, `shared` or `mig`.
    pub mode: String,
    /// `healthy`, `failed` or `unknown`.
    pub health: String,
    /// `used` (a session or job holds it) or `free`.
    pub r#use: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct MigLabels {
    /// The parent GPU's model.
    pub model: String,
    /// The MIG profile, such as `1g.10gb`.
    pub profile: String,
    /// `used` (a session or job holds it) or `free`.
    pub r#use: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct GroupLabels {
    /// An accounting group of the site's `[policy]` and `[fairshare]`.
    pub group: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ReservationLabels {
    pub reservation: String,
    /// The accounting group it is for.
    pub group: String,
    /// `active` (its window is open) or `upcoming`.
    pub status: String,
}

/// The events the manager counts where they happen.
pub struct Events {
    pub http_requests: Family<HttpLabels, Counter>,
    pub http_request_duration: Family<RouteLabels, Histogram>,
    pub holds: Family<ReasonLabels, Counter>,
    pub session_start: Histogram,
    pub plan_duration: Histogram,
    pub round_duration: Histogram,
    pub queued_sessions: Family<ReasonLabels, Gauge>,
}

static EVENTS: LazyLock<Events> = LazyLock::new(|| Events {
    http_requests: Family::default(),
    http_request_duration: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
    holds: Family::default(),
    session_start: Histogram::new(wait_buckets()),
    plan_duration: Histogram::new(latency_buckets()),
    round_duration: Histogram::new(latency_buckets()),
    queued_sessions: Family::default(),
});

/// The process-wide event handles.
pub fn events() -> &'static Events {
    &EVENTS
}

impl Events {
    /// A session was held (by a rule, its owner or an admin).
    pub fn held(&self, reason: HoldReason) {
        self.holds
            .get_or_create(&ReasonLabels {
                reason: reason.as_str().to_owned(),
            })
            .inc();
    }

    /// A session's container runs: `queued_at` is when it was requested (created, or released).
    pub fn started(&self, queued_at: DateTime<Utc>, now: DateTime<Utc>) {
        let seconds = (now - queued_at).num_milliseconds().max(0) as f64 / 1000.0;
        self.session_start.observe(seconds);
    }

    /// How long one scheduling plan took.
    pub fn plan_took(&self, elapsed: std::time::Duration) {
        self.plan_duration.observe(elapsed.as_secs_f64());
    }

    /// How long one whole scheduling round took: its reads, the plan and its writes.
    pub fn round_took(&self, elapsed: std::time::Duration) {
        self.round_duration.observe(elapsed.as_secs_f64());
    }

    /// What stays queued after a scheduling round, by why (see [`queue_reasons`]).
    pub fn queued(&self, queued: &BTreeMap<&'static str, i64>) {
        for reason in QUEUE_REASONS {
            self.queued_sessions
                .get_or_create(&ReasonLabels {
                    reason: reason.to_owned(),
                })
                .set(queued.get(reason).copied().unwrap_or(0));
        }
    }
}

/// The sessions a plan places.
pub fn placed_sessions(actions: &[Action]) -> HashSet<SessionId> {
    actions
        .iter()
        .filter_map(|action| match action {
            Action::Place { session, .. } => Some(*session),
            _ => None,
        })
        .collect()
}

/// The PENDING sessions a round leaves queued, by why: waiting for jobs to halt, pinned to the
/// node of their held container (`unpinned`: those whose node is offline, so not pinned), or
/// waiting for capacity.
pub fn queue_reasons<T>(
    pending: &[SessionRecord],
    placed: &HashSet<SessionId>,
    halt_waits: &HashMap<SessionId, T>,
    unpinned: &HashMap<SessionId, NodeName>,
) -> BTreeMap<&'static str, i64> {
    let mut queued = BTreeMap::new();
    for session in pending.iter().filter(|s| !placed.contains(&s.id)) {
        let reason = if halt_waits.contains_key(&session.id) {
            "awaiting_halt"
        } else if session.node.is_some() && !unpinned.contains_key(&session.id) {
            "pinned_node"
        } else {
            "no_capacity"
        };
        *queued.entry(reason).or_default() += 1;
    }
    queued
}

/// Why a PENDING session is still queued after a plan: released onto its node's GPUs
/// (`pinned_node`), waiting for batch jobs to halt (`awaiting_halt`), or no GPU fits
/// (`no_capacity`).
pub const QUEUE_REASONS: [&str; 3] = ["pinned_node", "awaiting_halt", "no_capacity"];

/// Axum middleware counting every request by its route template, method and status, each
/// label from a closed set ([`HttpLabels`]): the series stay few whatever clients send, also
/// while `/metrics` is not served (the counters live on).
pub async fn count_requests(request: Request, next: Next) -> Response {
    let route = route_label(request.extensions().get::<MatchedPath>());
    let method = method_label(request.method());
    let start = Instant::now();
    let response = next.run(request).await;
    let events = events();
    events
        .http_request_duration
        .get_or_create(&RouteLabels {
            route: route.clone(),
            method,
        })
        .observe(start.elapsed().as_secs_f64());
    events
        .http_requests
        .get_or_create(&HttpLabels {
            route,
            method,
            status: status_label(response.status()),
        })
        .inc();
    response
}

#[cfg(test)]
mod tests {
    use prometheus_client::registry::Registry;

    use super::*;

    /// 10,000 requests with made-up methods (and unmatched paths) add at most a few series:
    /// `/metrics` stays as long as it was, give or take those.
    #[tokio::test]
    async fn invented_methods_and_paths_add_no_series() {
        fn lines() -> usize {
            let mut registry = Registry::default();
            let events = events();
            registry.register("http_requests", "", events.http_requests.clone());
            registry.register(
                "http_request_duration",
                "",
                events.http_request_duration.clone(),
            );
            let mut text = String::new();
            prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
            text.lines().count()
        }
        let router = axum::Router::new()
            .route("/v1/nodes/{name}", axum::routing::get(|| async { "" }))
            .layer(axum::middleware::from_fn(count_requests));
        let before = lines();
        for n in 0..10_000 {
            let method = axum::http::Method::from_bytes(format!("BOGUS{n}").as_bytes()).unwrap();
            let path = if n % 2 == 0 {
                "/v1/nodes/node1".to_owned()
            } else {
                format!("/made/up/{n}")
            };
            let request = axum::http::Request::builder()
                .method(method)
                .uri(path)
                .body(axum::body::Body::empty())
                .unwrap();
            tower::ServiceExt::oneshot(router.clone(), request)
                .await
                .unwrap();
        }
        let after = lines();
        // A few new series (this test's two routes with `other`, and what tests running beside
        // it count), each a counter line and a histogram of some twenty lines: not 10,000.
        assert!(after - before <= 100, "{before} lines became {after}");
        let mut text = String::new();
        let mut registry = Registry::default();
        registry.register("http_requests", "", events().http_requests.clone());
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
        assert!(
            !text.contains("BOGUS") && !text.contains("/made/up"),
            "{text}"
        );
        assert!(
            text.contains(
                r#"http_requests_total{route="/v1/nodes/{name}",method="other",status="405"} 5000"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"http_requests_total{route="unmatched",method="other",status="404"} 5000"#
            ),
            "{text}"
        );
    }

    #[test]
    fn labels_come_from_closed_sets() {
        use axum::http::{Method, StatusCode};
        assert_eq!(method_label(&Method::GET), "GET");
        assert_eq!(method_label(&Method::PATCH), "PATCH");
        assert_eq!(
            method_label(&Method::from_bytes(b"PROPFIND").unwrap()),
            "other"
        );
        assert_eq!(status_label(StatusCode::CREATED), "201");
        assert_eq!(status_label(StatusCode::IM_A_TEAPOT), "4xx");
        assert_eq!(status_label(StatusCode::from_u16(599).unwrap()), "5xx");
        assert_eq!(route_label(None), "unmatched");
    }
}
