//! Live updates: `GET /dashboard/events?view=user|admin|job/<id>` is a server-sent event stream
//! of the page's live part, re-rendered (with [`super::data::render`], the same markup as the
//! page) whenever a commit may have changed it, as the API's long-polls learn of it
//! ([`crate::notify::Changes`]: a session's state, a freeze's progress, a job's output), and once
//! every [`REFRESH`] for the countdowns. Each event's id is the digest of its markup
//! ([`views::digest`]); the page says what it holds (`have`, the digest it was rendered with)
//! and a reconnecting browser sends the id it saw last (`Last-Event-ID`), so the stream starts
//! with the live part as it is only when the browser's differs (a browser that reconnects after
//! a dropped stream catches up at once), and sends an update only when the markup changed. The stream ends when the manager shuts
//! down or the login stops being valid; the browser's `EventSource` then reconnects, and a
//! logged-out page stops there.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::stream::{self, Stream};
use serde::Deserialize;

use super::auth::{PageError, Viewer};
use super::data::{self, Live};
use super::views;
use crate::app::AppState;
use crate::notify::Waiter;

/// How often the live part is rendered again without a change (deadlines count down).
pub const REFRESH: Duration = Duration::from_secs(30);

#[derive(Debug, Deserialize)]
pub struct LiveQuery {
    view: String,
    /// The digest of the live part the page holds.
    #[serde(default)]
    have: Option<String>,
}

struct Follow {
    state: AppState,
    viewer: Viewer,
    live: Live,
    changes: Waiter,
    /// The digest of what the browser holds.
    have: Option<String>,
    /// Whether the first look (no waiting) was made.
    started: bool,
}

pub async fn events(
    State(state): State<AppState>,
    viewer: Viewer,
    headers: HeaderMap,
    Query(query): Query<LiveQuery>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, PageError> {
    let live = Live::parse(&query.view)?;
    // Subscribed before the first render, so no change between the two is missed.
    let changes = state.changes.subscribe();
    // Refused now (a user asking for the admin view) rather than as an empty stream.
    data::render(&state, &viewer, &live).await?;
    let have = headers
        .get("last-event-id")
        .and_then(|id| id.to_str().ok())
        .map(str::to_owned)
        .or(query.have);
    let follow = Follow {
        state,
        viewer,
        live,
        changes,
        have,
        started: false,
    };
    let updates = stream::unfold(follow, |mut follow| async move {
        loop {
            // After the first look: a change, or the refresh's timeout; `false`: the manager
            // shuts down.
            if follow.started {
                let changed = tokio::time::timeout(REFRESH, follow.changes.changed()).await;
                if let Ok(false) = changed {
                    return None;
                }
            }
            let html = match data::render(&follow.state, &follow.viewer, &follow.live).await {
                Ok(markup) => markup.into_string(),
                Err(_) => return None,
            };
            follow.started = true;
            let id = views::digest(&html);
            if follow.have.as_deref() != Some(id.as_str()) {
                follow.have = Some(id.clone());
                let event = Event::default().event("update").id(id).data(html);
                return Some((Ok(event), follow));
            }
        }
    });
    Ok(Sse::new(updates).keep_alive(KeepAlive::default()))
}
