//! The application's one error type, [`ApiError`]: a status, a code and a message that says
//! what to do, answered by the API as an [`ongrid_core::api::ErrorBody`] and by the dashboard as
//! a page. Every use case of [`crate::app`] fails with it (or with its own error enum, whose
//! variants the transports word themselves).
//!
//! A 5xx says only "internal error"; its cause is logged once, where the [`ApiError`] is made. A
//! 401 or 403, whether the API answers it as JSON or the dashboard as a page, is logged once by
//! [`log_refusals`] with the caller, the address, the path and the reason, unless its handler
//! logged it already ([`ApiError::already_logged`]): the answer carries a [`Refused`] for it.

use std::fmt;
use std::sync::{Arc, OnceLock};

use axum::extract::Request;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ongrid_core::api::{ErrorBody, ErrorDetail};
use ongrid_core::Dn;

use crate::domain::Refusal;
use crate::store::StoreError;

#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    /// The handler logged this refusal itself, at the level it deserves.
    logged: bool,
}

/// A 401 or 403 answer's message, handed from [`ApiError`]'s response (or the dashboard's page)
/// to [`log_refusals`].
#[derive(Debug, Clone)]
pub struct Refused(pub String);

/// Who a request turned out to be from, when it is not the certificate of the connection (a
/// dashboard login cookie): [`log_page_refusals`] puts an empty one in the request, the extractor that
/// authenticates the caller fills it, and a refusal is logged with it.
#[derive(Debug, Clone, Default)]
pub struct CallerSlot(Arc<OnceLock<Dn>>);

impl CallerSlot {
    /// Records the caller; the first one recorded stays.
    pub fn set(&self, dn: &Dn) {
        let _ = self.0.set(dn.clone());
    }
}

/// What a refused request's log line says: who asked (the peer's address and the caller's DN,
/// from the connection's certificate or a dashboard login; a token is never logged), the
/// request and the reason.
struct RefusalRecord {
    status: u16,
    method: axum::http::Method,
    path: String,
    peer: Option<std::net::SocketAddr>,
    caller: Option<String>,
    reason: String,
}

/// Runs the request with an empty [`CallerSlot`] in it, and gives the record of its refusal, if
/// the answer carries a [`Refused`].
async fn run_noting_refusal(
    mut request: Request,
    next: axum::middleware::Next,
) -> (Response, Option<RefusalRecord>) {
    let peer = request
        .extensions()
        .get::<crate::grid_identity::Peer>()
        .map(|peer| {
            (
                peer.addr,
                peer.identity.as_ref().map(|identity| identity.dn.clone()),
            )
        });
    let slot = CallerSlot::default();
    request.extensions_mut().insert(slot.clone());
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let response = next.run(request).await;
    let record = response
        .extensions()
        .get::<Refused>()
        .map(|Refused(reason)| {
            let (address, certificate) = match &peer {
                Some((address, dn)) => (Some(*address), dn.clone()),
                None => (None, None),
            };
            RefusalRecord {
                status: response.status().as_u16(),
                method,
                path,
                peer: address,
                caller: certificate
                    .or_else(|| slot.0.get().cloned())
                    .map(|dn| dn.to_string()),
                reason: reason.clone(),
            }
        });
    (response, record)
}

/// Middleware of the API: logs every 401 and 403 once, with who asked, the request and the
/// reason. The reason and the path are logged with `Debug` formatting, so a caller's strings in
/// them cannot forge log lines.
pub async fn log_refusals(request: Request, next: axum::middleware::Next) -> Response {
    let (response, record) = run_noting_refusal(request, next).await;
    if let Some(r) = record {
        tracing::warn!(status = r.status, method = %r.method, path = ?r.path, peer = ?r.peer, caller = ?r.caller, reason = ?r.reason, "Request refused.");
    }
    response
}

/// [`log_refusals`] for the dashboard's pages, whose refusals name the login's DN when the
/// browser has no certificate. A log line of its own (the API's and the dashboard's refusals
/// are told apart in the log, and each has its own `tracing` call site).
pub async fn log_page_refusals(request: Request, next: axum::middleware::Next) -> Response {
    let (response, record) = run_noting_refusal(request, next).await;
    if let Some(r) = record {
        tracing::warn!(status = r.status, method = %r.method, path = ?r.path, peer = ?r.peer, caller = ?r.caller, reason = ?r.reason, "Dashboard request refused.");
    }
    response
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            logged: false,
        }
    }

    /// Marks a refusal its handler has logged, so `log_refusals` does not log it again.
    pub fn already_logged(mut self) -> Self {
        self.logged = true;
        self
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthenticated", message)
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", message)
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", message)
    }

    pub fn unsatisfiable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "unsatisfiable", message)
    }

    /// A service the request needs (a grid target's engine) cannot be reached; `message` says
    /// what to do and nothing of the cause, which the caller logged.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }

    /// What stands behind the manager (a session's web server, its node's agent) failed to
    /// answer; `message` says what to do.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "bad_gateway", message)
    }

    /// What stands behind the manager did not answer in time.
    pub fn gateway_timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "gateway_timeout", message)
    }

    /// Logs `cause` (the only place it is logged) and answers "internal error".
    pub fn internal(cause: impl fmt::Display) -> Self {
        tracing::error!(error = %cause, "Request failed.");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "internal error",
        )
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<Refusal> for ApiError {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::Invalid(message) => Self::bad_request(message),
            Refusal::Conflict(message) => Self::conflict(message),
            Refusal::Forbidden(message) => Self::forbidden(message),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::InvalidTransition(e) => Self::conflict(e.to_string()),
            StoreError::UserRemoved(dn) => Self::forbidden(format!(
                "an admin removed {dn} while this request ran: ask a site admin to run \
                 `devctl admin user restore '{dn}'`"
            )),
            other => Self::internal(other),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let refused = (matches!(
            self.status,
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
        ) && !self.logged)
            .then(|| Refused(self.message.clone()));
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.to_owned(),
                message: self.message,
            },
        };
        let mut response = (self.status, Json(body)).into_response();
        if let Some(refused) = refused {
            response.extensions_mut().insert(refused);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The captured output of a `tracing` subscriber.
    #[derive(Clone, Default)]
    struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A dashboard refusal is logged once, with the login's DN (the browser has no
    /// certificate), the peer's address and the path; a page that is not refused is not.
    #[test]
    fn a_page_refusal_is_logged_with_the_login_the_address_and_the_path() {
        use axum::routing::get;
        use tower::ServiceExt;

        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let router = axum::Router::new()
            .route(
                "/dashboard/admin",
                get(|request: Request| async move {
                    // What the dashboard's login extractor does, then its refusal page.
                    let bob = Dn::parse("/DC=org/CN=Bob").unwrap();
                    request.extensions().get::<CallerSlot>().unwrap().set(&bob);
                    let mut page = (StatusCode::FORBIDDEN, "only admins").into_response();
                    page.extensions_mut()
                        .insert(Refused("only admins see the admin pages".to_owned()));
                    page
                }),
            )
            .route("/dashboard/", get(|| async { "your sessions" }))
            .layer(axum::middleware::from_fn(log_page_refusals));
        let peer = crate::grid_identity::Peer {
            addr: "127.0.0.1:40000".parse().unwrap(),
            identity: None,
        };
        for path in ["/dashboard/admin", "/dashboard/"] {
            let mut request = Request::builder()
                .uri(path)
                .body(axum::body::Body::empty())
                .unwrap();
            request.extensions_mut().insert(peer.clone());
            runtime.block_on(router.clone().oneshot(request)).unwrap();
        }
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text
            .lines()
            .filter(|line| line.contains("Dashboard request refused."))
            .collect();
        assert_eq!(lines.len(), 1, "{text}");
        for part in [
            "status=403",
            "path=\"/dashboard/admin\"",
            "peer=Some(127.0.0.1:40000)",
            "caller=Some(\"/DC=org/CN=Bob\")",
            "reason=\"only admins see the admin pages\"",
        ] {
            assert!(lines[0].contains(part), "{part} in {}", lines[0]);
        }
    }

    #[tokio::test]
    async fn errors_are_error_bodies() {
        let response = ApiError::not_found("no session named x").into_response();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let body: ErrorBody = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(body.error.code, "not_found");
        assert_eq!(body.error.message, "no session named x");
    }

    #[tokio::test]
    async fn internal_errors_hide_their_cause() {
        let response = ApiError::internal("disk on fire").into_response();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let body: ErrorBody = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(body.error.code, "internal");
        assert_eq!(body.error.message, "internal error");
    }
}
