//! Live updates: `GET /dashboard/events?view=user|admin|job/<id>` is a server-sent event stream
//! of the page's live part, re-rendered (with [`super::data::render`], the same markup as the
//! page) whenever a commit may have changed it, as the API's long-polls learn of it
//! ([`crate::notify::Changes`]: a session's state, a freeze's progress, a job's output), and once
//! every [`REFRESH`] for the countdowns. An update is sent only when the markup differs. The
//! stream ends when the manager shuts down or the login stops being valid; the browser's
//! `EventSource` then reconnects, and a logged-out page stops there.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::stream::{self, Stream};
use serde::Deserialize;

use super::auth::{PageError, Viewer};
use super::data::{self, Live};
use crate::api::AppState;
use crate::notify::Waiter;

/// How often the live part is rendered again without a change (deadlines count down).
pub const REFRESH: Duration = Duration::from_secs(30);

#[derive(Debug, Deserialize)]
pub struct LiveQuery {
    view: String,
}

struct Follow {
    state: AppState,
    viewer: Viewer,
    live: Live,
    changes: Waiter,
    last: Option<String>,
}

pub async fn events(
    State(state): State<AppState>,
    viewer: Viewer,
    Query(query): Query<LiveQuery>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, PageError> {
    let live = Live::parse(&query.view)?;
    // Subscribed before the first render, so no change between the two is missed.
    let changes = state.changes.subscribe();
    // Refused now (a user asking for the admin view) rather than as an empty stream.
    let first = data::render(&state, &viewer, &live).await?.into_string();
    let follow = Follow {
        state,
        viewer,
        live,
        changes,
        last: Some(first),
    };
    let updates = stream::unfold(follow, |mut follow| async move {
        loop {
            // A change, or the refresh's timeout; `false`: the manager shuts down.
            if let Ok(false) = tokio::time::timeout(REFRESH, follow.changes.changed(None)).await {
                return None;
            }
            let html = match data::render(&follow.state, &follow.viewer, &follow.live).await {
                Ok(markup) => markup.into_string(),
                Err(_) => return None,
            };
            if follow.last.as_deref() != Some(html.as_str()) {
                follow.last = Some(html.clone());
                let event = Event::default().event("update").data(html);
                return Some((Ok(event), follow));
            }
        }
    });
    Ok(Sse::new(updates).keep_alive(KeepAlive::default()))
}
