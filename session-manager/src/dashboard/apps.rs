//! A session's web apps through the dashboard, for its owner's browser:
//!
//! - `/dashboard/sessions/{name}/apps/`: what the session serves (JupyterLab, the ports its
//!   programs listen on), with links;
//! - `/dashboard/sessions/{name}/apps/jupyter/...`: JupyterLab, whose base URL is that path;
//! - `/dashboard/sessions/{name}/apps/port/{port}/...`: any web server of the session, the
//!   prefix taken off (`X-Forwarded-Prefix` says what it was).
//!
//! Who reaches what, and JupyterLab's start, are decided by `crate::app::web_apps`; this module
//! carries the bytes. HTTP goes over pooled HTTP/1.1 connections, each one agent stream to the
//! port inside the session; bodies stream through, never read whole, so a 1 GiB upload or
//! download costs the buffers of one connection. A WebSocket is relayed message by message
//! (each at most [`MAX_MESSAGE`]), so the relay can close it with a reason the browser shows
//! (the session was held) and count what the browser sends as its activity. The login cookie
//! never reaches the session, nor the browser's `Authorization`; JupyterLab's own token is
//! added here. A request that changes something, and every WebSocket, must come from the
//! dashboard's own origin.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{any, get};
use axum::{Extension, Router};
use futures::{SinkExt, StreamExt};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use maud::html;
use ongrid_core::SessionState;
use ongrid_service::agent_stream::AgentBytes;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use super::auth::{PageError, Viewer, COOKIE, NOTICE_COOKIE};
use super::views;
use crate::app::web_apps::{self, WebApp, WebApps, WebTarget};
use crate::app::{ApiError, AppState};
use crate::grid_identity::Peer;

/// The largest WebSocket message relayed (a notebook output with images can be megabytes).
pub const MAX_MESSAGE: usize = 64 * 1024 * 1024;
/// How long a web server may take to begin its answer.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// How long an unused pooled connection to a session's port is kept.
const POOL_IDLE: Duration = Duration::from_secs(30);
/// Targets not used for this long are dropped from the connector's table.
const TARGET_IDLE: Duration = Duration::from_secs(600);

/// The script put into JupyterLab's pages: it asks [`warning`] every minute and shows what it
/// says above the page.
const WARNING_SCRIPT: &str = include_str!("static/session-warning.js");
/// The largest page the warning script is put into (JupyterLab's are a few KiB).
const MAX_INJECTED_PAGE: usize = 4 * 1024 * 1024;

/// The HTTP client of sessions' web apps.
pub struct Proxy {
    client: Client<StreamConnector, Body>,
    targets: Targets,
}

impl Proxy {
    pub fn new(apps: Arc<WebApps>) -> Self {
        let targets = Targets::default();
        let connector = StreamConnector {
            apps,
            targets: targets.clone(),
        };
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE)
            .pool_max_idle_per_host(8)
            .build(connector);
        Self { client, targets }
    }
}

/// What the connector connects to, by the pool key the request's URI carries as its host.
#[derive(Clone, Default)]
struct Targets(Arc<Mutex<HashMap<String, (WebTarget, Instant)>>>);

impl Targets {
    fn put(&self, target: &WebTarget) -> String {
        let key = target.pool_key();
        let mut table = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        table.retain(|_, (_, used)| now.duration_since(*used) < TARGET_IDLE);
        table.insert(key.clone(), (target.clone(), now));
        key
    }

    fn get(&self, key: &str) -> Option<WebTarget> {
        let table = self.0.lock().unwrap_or_else(|e| e.into_inner());
        table.get(key).map(|(target, _)| target.clone())
    }
}

/// Connects the pooled client's connections: an agent stream to the target's port.
#[derive(Clone)]
struct StreamConnector {
    apps: Arc<WebApps>,
    targets: Targets,
}

/// Why a connection to a session's port could not be made; its text is for the user.
#[derive(Debug)]
struct ConnectError(ApiError);

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.message())
    }
}

impl std::error::Error for ConnectError {}

impl tower::Service<Uri> for StreamConnector {
    type Response = TokioIo<AgentBytes>;
    type Error = ConnectError;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let target = uri.host().and_then(|key| self.targets.get(key));
        let apps = self.apps.clone();
        Box::pin(async move {
            let mut target = target.ok_or_else(|| {
                ConnectError(ApiError::internal(
                    "a web app connection without its target",
                ))
            })?;
            let bytes = apps.connect(&mut target).await.map_err(ConnectError)?;
            Ok(TokioIo::new(bytes))
        })
    }
}

/// The routes of sessions' web apps, merged into the dashboard's router. Unlike the pages',
/// their answers are the session's own (its headers, its scripts), and bodies stream.
pub fn router(state: AppState) -> Router {
    let proxy = Arc::new(Proxy::new(state.web_apps.clone()));
    Router::new()
        .route("/dashboard/sessions/{name}/apps", get(with_slash))
        .route("/dashboard/sessions/{name}/apps/", get(apps_page))
        .route("/dashboard/sessions/{name}/apps/warning", get(warning))
        .route(
            "/dashboard/static/session-warning.js",
            get(|| async {
                (
                    [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
                    WARNING_SCRIPT,
                )
            }),
        )
        .route("/dashboard/sessions/{name}/apps/jupyter", get(with_slash))
        .route("/dashboard/sessions/{name}/apps/jupyter/", any(proxied))
        .route(
            "/dashboard/sessions/{name}/apps/jupyter/{*rest}",
            any(proxied),
        )
        .route(
            "/dashboard/sessions/{name}/apps/port/{port}",
            get(with_slash),
        )
        .route("/dashboard/sessions/{name}/apps/port/{port}/", any(proxied))
        .route(
            "/dashboard/sessions/{name}/apps/port/{port}/{*rest}",
            any(proxied),
        )
        .layer(Extension(proxy))
        .layer(axum::middleware::from_fn(
            crate::app::error::log_page_refusals,
        ))
        .layer(axum::middleware::from_fn(crate::metrics::count_requests))
        .with_state(state)
}

/// An app's address without its trailing slash: the same with it, where relative links work.
async fn with_slash(uri: Uri) -> Redirect {
    Redirect::permanent(&format!("{}/", uri.path()))
}

/// Every request of a session's app: JupyterLab's, or a port's when the route names one.
async fn proxied(
    State(state): State<AppState>,
    Extension(proxy): Extension<Arc<Proxy>>,
    Path(params): Path<HashMap<String, String>>,
    request: Request,
) -> Response {
    let app = match params.get("port").map(|port| parse_port(port)) {
        None => WebApp::Jupyter,
        Some(Ok(port)) => WebApp::Port(port),
        Some(Err(refusal)) => return refusal.into_response(),
    };
    let name = params.get("name").map_or("", String::as_str);
    forward(&state, &proxy, name, app, request).await
}

fn parse_port(text: &str) -> Result<u16, PageError> {
    text.parse::<u16>()
        .ok()
        .filter(|port| *port > 0)
        .ok_or_else(|| {
            PageError(ApiError::bad_request(format!(
                "{text:?} is not a port: the address is /dashboard/sessions/NAME/apps/port/PORT/ \
                 with PORT from 1 to 65535"
            )))
        })
}

/// Checks the viewer and the origin, finds the target and hands the request to HTTP or
/// WebSocket.
async fn forward(
    state: &AppState,
    proxy: &Proxy,
    name: &str,
    app: WebApp,
    request: Request,
) -> Response {
    let (mut parts, body) = request.into_parts();
    let upgrade = is_websocket(&parts.headers);
    let viewer = match <Viewer as axum::extract::FromRequestParts<AppState>>::from_request_parts(
        &mut parts, state,
    )
    .await
    {
        Ok(viewer) => viewer,
        Err(refusal) if upgrade => {
            return refused_upgrade(Request::from_parts(parts, body), refusal.0.message());
        }
        Err(refusal) => return refusal.into_response(),
    };
    // HTTP/2 carries the host as the URI's authority, HTTP/1.1 as the Host header; the
    // session's server gets it as Host either way.
    let Some(host) = request_host(&parts) else {
        return PageError(ApiError::bad_request("a request without a host")).into_response();
    };
    parts.headers.insert(header::HOST, host.clone());
    let changes = !matches!(parts.method, Method::GET | Method::HEAD | Method::OPTIONS);
    if changes || upgrade {
        if let Err(refusal) = same_origin(&parts.headers, host.to_str().unwrap_or_default()) {
            return refusal.into_response();
        }
    }
    let target = match state
        .web_apps
        .target(state, &viewer.caller, name, app)
        .await
    {
        Ok(target) => target,
        Err(refusal) if upgrade => {
            return refused_upgrade(Request::from_parts(parts, body), refusal.message());
        }
        Err(refusal) => return PageError(refusal).into_response(),
    };
    let path = upstream_path(&parts.uri, app, &target.session.name);
    let source = parts
        .extensions
        .get::<Peer>()
        .map(|peer| peer.addr)
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    if upgrade {
        return websocket(
            state,
            target,
            Request::from_parts(parts, body),
            &path,
            source,
        )
        .await;
    }
    if changes {
        let size = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(1);
        state.web_apps.note_change(target.session.id, size);
    }
    http(proxy, &target, parts, body, &path, source).await
}

/// The path (and query) the session's server gets: JupyterLab's is the whole path (its base
/// URL is the prefix), a port's has the prefix taken off.
fn upstream_path(uri: &Uri, app: WebApp, session: &ongrid_core::SessionName) -> String {
    let path_and_query = uri
        .path_and_query()
        .map_or_else(|| uri.path().to_owned(), |pq| pq.as_str().to_owned());
    match app {
        WebApp::Jupyter => path_and_query,
        WebApp::Port(_) => {
            let prefix = app.base_path(session);
            let rest = path_and_query
                .strip_prefix(prefix.trim_end_matches('/'))
                .unwrap_or(&path_and_query);
            if rest.starts_with('/') {
                rest.to_owned()
            } else {
                format!("/{rest}")
            }
        }
    }
}

/// A request that changes something, or opens a WebSocket, must come from the dashboard's own
/// pages (or the session's, which are on the same origin): the browser's `Origin` must be this
/// host's.
fn same_origin(headers: &HeaderMap, host: &str) -> Result<(), PageError> {
    match headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
        None => Ok(()),
        Some(origin) if origin == format!("https://{host}") => Ok(()),
        Some(origin) => Err(PageError(ApiError::forbidden(format!(
            "a page of {origin} may not use a session's web apps: open them from the dashboard"
        )))),
    }
}

/// The host the browser asked for: the Host header, else the URI's authority (HTTP/2).
fn request_host(parts: &axum::http::request::Parts) -> Option<HeaderValue> {
    parts.headers.get(header::HOST).cloned().or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|authority| HeaderValue::from_str(authority.as_str()).ok())
    })
}

fn is_websocket(headers: &HeaderMap) -> bool {
    let has = |name: HeaderName, token: &str| {
        headers.get_all(name).iter().any(|value| {
            value.to_str().is_ok_and(|value| {
                value
                    .split(',')
                    .any(|part| part.trim().eq_ignore_ascii_case(token))
            })
        })
    };
    has(header::UPGRADE, "websocket") && has(header::CONNECTION, "upgrade")
}

/// Headers that belong to one connection (RFC 9110, section 7.6.1) and are never forwarded.
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

/// The browser's headers as the session's server gets them: no hop-by-hop headers, no
/// `Authorization`, the dashboard's cookies taken out of `Cookie`, JupyterLab's token added,
/// and where the request came from.
fn upstream_headers(from: &HeaderMap, target: &WebTarget, source: SocketAddr) -> HeaderMap {
    let mut headers = HeaderMap::with_capacity(from.len() + 4);
    for (name, value) in from {
        if HOP_BY_HOP.contains(name)
            || *name == header::AUTHORIZATION
            || *name == header::COOKIE
            || *name == header::UPGRADE
            || name.as_str().starts_with("sec-websocket-")
            || name.as_str().starts_with("x-forwarded-")
        {
            continue;
        }
        headers.append(name.clone(), value.clone());
    }
    let cookies: Vec<&str> = from
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .map(str::trim)
        .filter(|cookie| {
            let name = cookie.split('=').next().unwrap_or_default();
            !cookie.is_empty() && name != COOKIE && name != NOTICE_COOKIE
        })
        .collect();
    if !cookies.is_empty() {
        if let Ok(value) = HeaderValue::from_str(&cookies.join("; ")) {
            headers.insert(header::COOKIE, value);
        }
    }
    if let Some(token) = &target.token {
        if let Ok(value) = HeaderValue::from_str(&format!("token {token}")) {
            headers.insert(header::AUTHORIZATION, value);
        }
    }
    let forwarded = [
        ("x-forwarded-for", source.ip().to_string()),
        ("x-forwarded-proto", "https".to_owned()),
        (
            "x-forwarded-prefix",
            target
                .app
                .base_path(&target.session.name)
                .trim_end_matches('/')
                .to_owned(),
        ),
    ];
    for (name, value) in forwarded {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(HeaderName::from_static(name), value);
        }
    }
    if let Some(host) = from.get(header::HOST) {
        headers.insert(HeaderName::from_static("x-forwarded-host"), host.clone());
    }
    headers
}

/// One HTTP request through a pooled connection to the session's port; the body streams both
/// ways.
async fn http(
    proxy: &Proxy,
    target: &WebTarget,
    parts: axum::http::request::Parts,
    body: Body,
    path: &str,
    source: SocketAddr,
) -> Response {
    let key = proxy.targets.put(target);
    let uri = match Uri::builder()
        .scheme("http")
        .authority(key.as_str())
        .path_and_query(path)
        .build()
    {
        Ok(uri) => uri,
        Err(error) => {
            return PageError(ApiError::bad_request(format!("this address: {error}")))
                .into_response();
        }
    };
    let mut request = axum::http::Request::new(body);
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = uri;
    *request.headers_mut() = upstream_headers(&parts.headers, target, source);
    let name = &target.session.name;
    let answer = match tokio::time::timeout(ANSWER_TIMEOUT, proxy.client.request(request)).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(error)) => {
            let refusal = find_cause::<ConnectError>(&error).map_or_else(
                || {
                    tracing::debug!(session = %name, port = target.port, %error, "A web app request failed.");
                    ApiError::bad_gateway(format!(
                        "the web server on port {} of session {name} broke off its answer: \
                         reload; if it lasts, look at the server's output in the session",
                        target.port
                    ))
                },
                |cause| ApiError::bad_gateway(cause.0.message().to_owned()),
            );
            return PageError(refusal).into_response();
        }
        Err(_) => {
            return PageError(ApiError::gateway_timeout(format!(
                "the web server on port {} of session {name} did not answer within {} s: \
                 check that it is not stuck, then reload",
                target.port,
                ANSWER_TIMEOUT.as_secs()
            )))
            .into_response();
        }
    };
    let (mut answer_parts, answer_body) = answer.into_parts();
    for name in HOP_BY_HOP {
        answer_parts.headers.remove(name);
    }
    strip_dashboard_cookies(&mut answer_parts.headers);
    let body = Body::new(answer_body);
    if target.app == WebApp::Jupyter && is_plain_html(&answer_parts) {
        return with_warning(answer_parts, body, &target.session.name).await;
    }
    Response::from_parts(answer_parts, body)
}

/// A successful, uncompressed HTML page (JupyterLab's own).
fn is_plain_html(parts: &axum::http::response::Parts) -> bool {
    parts.status == StatusCode::OK
        && !parts.headers.contains_key(header::CONTENT_ENCODING)
        && parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/html"))
}

/// The page with the warning script put in its head, so the user sees a coming hold while
/// working in JupyterLab, as an SSH terminal does. A page too large to hold, or without a
/// head, goes out as it came.
async fn with_warning(
    mut parts: axum::http::response::Parts,
    body: Body,
    session: &ongrid_core::SessionName,
) -> Response {
    let page = match axum::body::to_bytes(body, MAX_INJECTED_PAGE).await {
        Ok(page) => page,
        Err(error) => {
            tracing::debug!(%session, %error, "A JupyterLab page could not be read whole.");
            return PageError(ApiError::bad_gateway(format!(
                "JupyterLab of session {session} sent a page that could not be read: reload"
            )))
            .into_response();
        }
    };
    let text = String::from_utf8_lossy(&page);
    let Some(at) = text.find("</head>") else {
        return Response::from_parts(parts, Body::from(page));
    };
    let script = format!(
        "<script src=\"/dashboard/static/session-warning.js\" data-session=\"{session}\" \
         defer></script>"
    );
    let injected = format!("{}{script}{}", &text[..at], &text[at..]);
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(injected))
}

/// `GET /dashboard/sessions/{name}/apps/warning`: what the pages of the session's apps show
/// above themselves (`{"warning": null}` when nothing).
async fn warning(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(name): Path<String>,
) -> Result<Response, PageError> {
    let warning = state
        .web_apps
        .warning(&state, &viewer.caller, &name)
        .await?;
    Ok((
        [(header::CACHE_CONTROL, "no-store")],
        axum::Json(serde_json::json!({ "warning": warning })),
    )
        .into_response())
}

/// A session's server may not set (or clear) the dashboard's own cookies.
fn strip_dashboard_cookies(headers: &mut HeaderMap) {
    let kept: Vec<HeaderValue> = headers
        .get_all(header::SET_COOKIE)
        .iter()
        .filter(|value| {
            let name = value
                .to_str()
                .unwrap_or_default()
                .split('=')
                .next()
                .unwrap_or_default()
                .trim();
            name != COOKIE && name != NOTICE_COOKIE
        })
        .cloned()
        .collect();
    headers.remove(header::SET_COOKIE);
    for value in kept {
        headers.append(header::SET_COOKIE, value);
    }
}

fn find_cause<'a, E: std::error::Error + 'static>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a E> {
    let mut cause = Some(error);
    while let Some(error) = cause {
        if let Some(found) = error.downcast_ref::<E>() {
            return Some(found);
        }
        cause = error.source();
    }
    None
}

fn websocket_config() -> WebSocketConfig {
    WebSocketConfig::default()
        .max_message_size(Some(MAX_MESSAGE))
        .max_frame_size(Some(MAX_MESSAGE))
        .max_write_buffer_size(MAX_MESSAGE + 1024 * 1024)
}

/// The `101 Switching Protocols` answer to the browser's upgrade.
fn switching(headers: &HeaderMap, protocol: Option<&HeaderValue>) -> Option<Response> {
    let key = headers.get(header::SEC_WEBSOCKET_KEY)?;
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
    let mut answer = Response::new(Body::empty());
    *answer.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let headers = answer.headers_mut();
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    headers.insert(
        header::SEC_WEBSOCKET_ACCEPT,
        HeaderValue::from_str(&accept).ok()?,
    );
    if let Some(protocol) = protocol {
        headers.insert(header::SEC_WEBSOCKET_PROTOCOL, protocol.clone());
    }
    Some(answer)
}

/// A close reason fits in a control frame (123 bytes); cut at a character boundary.
fn close_reason(text: &str) -> String {
    let mut end = text.len().min(123);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// Relays one WebSocket between the browser and the session's server.
async fn websocket(
    state: &AppState,
    mut target: WebTarget,
    request: Request,
    path: &str,
    source: SocketAddr,
) -> Response {
    let headers = request.headers().clone();
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("localhost")
        .to_owned();
    let name = target.session.name.clone();
    let bytes = match state.web_apps.connect(&mut target).await {
        Ok(bytes) => bytes,
        Err(refusal) => return refused_upgrade(request, refusal.message()),
    };
    let upstream_request = match format!("ws://{host}{path}").into_client_request() {
        Ok(mut upstream) => {
            let forwarded = upstream_headers(&headers, &target, source);
            for (name, value) in &forwarded {
                if *name == header::HOST {
                    continue;
                }
                upstream.headers_mut().append(name.clone(), value.clone());
            }
            if let Some(protocols) = headers.get(header::SEC_WEBSOCKET_PROTOCOL) {
                upstream
                    .headers_mut()
                    .insert(header::SEC_WEBSOCKET_PROTOCOL, protocols.clone());
            }
            upstream
        }
        Err(error) => {
            return refused_upgrade(request, &format!("this address cannot be relayed: {error}"));
        }
    };
    let (upstream, answer) = match tokio::time::timeout(
        ANSWER_TIMEOUT,
        tokio_tungstenite::client_async_with_config(
            upstream_request,
            bytes,
            Some(websocket_config()),
        ),
    )
    .await
    {
        Ok(Ok(done)) => done,
        Ok(Err(error)) => {
            tracing::debug!(session = %name, port = target.port, %error, "A web app refused a WebSocket.");
            return refused_upgrade(
                request,
                &format!(
                    "the web server on port {} of session {name} refused the WebSocket",
                    target.port
                ),
            );
        }
        Err(_) => {
            return refused_upgrade(
                request,
                &format!(
                    "the web server on port {} of session {name} did not answer",
                    target.port
                ),
            );
        }
    };
    let protocol = answer
        .headers()
        .get(header::SEC_WEBSOCKET_PROTOCOL)
        .cloned();
    let Some(switched) = switching(&headers, protocol.as_ref()) else {
        return PageError(ApiError::bad_request("a WebSocket upgrade without its key"))
            .into_response();
    };
    let connection = match web_apps::browser_opened(state, &target, source.ip()).await {
        Ok(connection) => connection,
        Err(refusal) => return PageError(refusal).into_response(),
    };
    let state = state.clone();
    tokio::spawn(async move {
        let upgraded = match hyper::upgrade::on(request).await {
            Ok(upgraded) => upgraded,
            Err(error) => {
                tracing::debug!(%error, "The browser's WebSocket upgrade failed.");
                web_apps::browser_closed(&state, &connection).await;
                return;
            }
        };
        let browser = WebSocketStream::from_raw_socket(
            TokioIo::new(upgraded),
            Role::Server,
            Some(websocket_config()),
        )
        .await;
        relay(&state, &target, browser, upstream, &connection).await;
        web_apps::browser_closed(&state, &connection).await;
    });
    switched
}

/// The browser's upgrade refused: accepted, then closed at once with why (1008, policy
/// violation), so that a page sees the reason in its close event.
fn refused_upgrade(request: Request, why: &str) -> Response {
    let reason = close_reason(why);
    let Some(answer) = switching(request.headers(), None) else {
        return PageError(ApiError::bad_request(why.to_owned())).into_response();
    };
    tokio::spawn(async move {
        let Ok(upgraded) = hyper::upgrade::on(request).await else {
            return;
        };
        let mut browser = WebSocketStream::from_raw_socket(
            TokioIo::new(upgraded),
            Role::Server,
            Some(websocket_config()),
        )
        .await;
        let _ = browser
            .close(Some(CloseFrame {
                code: CloseCode::Policy,
                reason: reason.into(),
            }))
            .await;
    });
    answer
}

/// Moves messages both ways until one side closes. What the browser sends is its activity,
/// reported every [`web_apps::ACTIVITY_REPORT`]. When the session's side breaks (its container
/// stopped), the browser is told why in the close.
async fn relay<B, U>(
    state: &AppState,
    target: &WebTarget,
    browser: WebSocketStream<B>,
    upstream: WebSocketStream<U>,
    connection: &web_apps::BrowserConnection,
) where
    B: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    use std::sync::atomic::Ordering;
    let (mut to_browser, mut from_browser) = browser.split();
    let (mut to_upstream, mut from_upstream) = upstream.split();
    let mut report = tokio::time::interval(web_apps::ACTIVITY_REPORT);
    report.tick().await;
    let mut reported = 0u64;
    let ended_by_session = loop {
        tokio::select! {
            message = from_browser.next() => match message {
                Some(Ok(Message::Close(frame))) => {
                    let _ = to_upstream.send(Message::Close(frame)).await;
                    break false;
                }
                Some(Ok(message)) => {
                    if matches!(message, Message::Text(_) | Message::Binary(_)) {
                        connection.bytes_in.fetch_add(message.len() as u64, Ordering::Relaxed);
                    }
                    if to_upstream.send(message).await.is_err() {
                        break true;
                    }
                }
                Some(Err(_)) | None => {
                    let _ = to_upstream.close().await;
                    break false;
                }
            },
            message = from_upstream.next() => match message {
                Some(Ok(Message::Close(frame))) => {
                    let _ = to_browser.send(Message::Close(frame)).await;
                    break false;
                }
                Some(Ok(message)) => {
                    connection.bytes_out.fetch_add(message.len() as u64, Ordering::Relaxed);
                    if to_browser.send(message).await.is_err() {
                        let _ = to_upstream.close().await;
                        break false;
                    }
                }
                Some(Err(_)) | None => break true,
            },
            _ = report.tick() => {
                let sent = connection.bytes_in.load(Ordering::Relaxed);
                if sent != reported {
                    reported = sent;
                    web_apps::browser_activity(state, connection).await;
                }
            }
        }
    };
    if ended_by_session {
        let why = why_it_ended(state, target).await;
        let _ = to_browser
            .send(Message::Close(Some(CloseFrame {
                code: CloseCode::Away,
                reason: close_reason(&why).into(),
            })))
            .await;
    }
}

/// Why the session's side of a WebSocket ended, in words for the browser.
async fn why_it_ended(state: &AppState, target: &WebTarget) -> String {
    let name = &target.session.name;
    match crate::app::web_apps::session_now(state, target).await {
        Ok(Some(session)) if session.state == SessionState::Held => format!(
            "session {name} is HELD: release it (dashboard or devctl session release {name}), then reload"
        ),
        Ok(Some(session)) if session.state == SessionState::Ended => {
            format!("session {name} has ended")
        }
        Ok(Some(session))
            if !matches!(
                session.state,
                SessionState::Waiting | SessionState::Connected | SessionState::Idle
            ) =>
        {
            format!("session {name} is {}: reload when it runs", session.state)
        }
        _ => format!(
            "the server on port {} of session {name} closed the connection: reload",
            target.port
        ),
    }
}

/// `GET /dashboard/sessions/{name}/apps/`: the session's JupyterLab and the ports its programs
/// listen on, each a link.
async fn apps_page(
    State(state): State<AppState>,
    viewer: Viewer,
    Path(name): Path<String>,
) -> Result<Response, PageError> {
    let ports = state
        .web_apps
        .listening_ports(&state, &viewer.caller, &name)
        .await?;
    let jupyter = WebApp::Jupyter.base_path(&ports.session);
    let body = html! {
        p { "Web apps of session " strong { (ports.session.as_str()) } " open in this browser, "
            "through the dashboard: nothing of them is reachable without your login." }
        p { a class="button" href=(jupyter) target="_blank" rel="noopener" { "Open JupyterLab" } }
        h2 { "Web ports" }
        @if ports.ports.is_empty() {
            p { "No program of the session listens on a TCP port yet. Start a web server "
                "(TensorBoard, a Gradio or Streamlit demo) on 127.0.0.1 or 0.0.0.0, then reload "
                "this page." }
        } @else {
            table {
                thead { tr { th { "Port" } th { "Listening on" } th { "Open" } } }
                tbody {
                    @for port in &ports.ports {
                        tr {
                            td { (port.port) }
                            td { (port.address) }
                            td {
                                @if port.jupyter {
                                    a href=(jupyter) target="_blank" rel="noopener" { "JupyterLab" }
                                } @else {
                                    a href=(WebApp::Port(port.port).base_path(&ports.session))
                                        target="_blank" rel="noopener" { "Open port " (port.port) }
                                }
                            }
                        }
                    }
                }
            }
        }
        p { "What is proxied: HTTP and WebSockets, each request and message checked against "
            "your login. A server that builds absolute links must be told its prefix (it gets "
            "it as X-Forwarded-Prefix): TensorBoard --path_prefix, Gradio root_path." }
        p { a href="/dashboard/" { "Back to your sessions" } }
    };
    let page = views::layout(&format!("Web apps of {}", ports.session), None, None, body);
    Ok(page.into_response())
}
