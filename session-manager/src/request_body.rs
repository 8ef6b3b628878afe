//! Every request body is read to its end before a handler answers.
//!
//! A handler may refuse before it looks at the body (a 401 from the caller's certificate, a
//! 403 for a token speaking for another node). Over HTTP/2, answering while the client is
//! still sending makes the server reset the stream (`RST_STREAM` with `NO_ERROR`, which the
//! protocol allows), and common clients (curl 7.88 among them) then report a framing error
//! instead of the answer. Reading the body first keeps every answer intact. Handlers read
//! their JSON bodies whole anyway, so this holds nothing more in memory than they did.

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

use crate::app::ApiError;

/// The largest request body the API takes: axum's limit for JSON bodies.
pub const MAX_BODY_BYTES: usize = 2 * 1024 * 1024;

/// How much of a body over [`MAX_BODY_BYTES`] is still read, and dropped, so that the 413
/// reaches the client; past this the connection's stream is reset.
const MAX_DRAINED_BYTES: usize = 64 * 1024 * 1024;

/// Reads the request's body whole (up to [`MAX_BODY_BYTES`]) before the handler runs; a
/// larger body is drained and refused with a 413 that names the limit.
pub async fn read_whole_body(request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    match read_body(body).await {
        Ok(bytes) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Err(error) => error.into_response(),
    }
}

async fn read_body(body: Body) -> Result<Bytes, ApiError> {
    let mut stream = body.into_data_stream();
    let mut kept = Vec::new();
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_request(format!("reading the body: {e}")))?;
        seen = seen.saturating_add(chunk.len());
        if seen <= MAX_BODY_BYTES {
            kept.extend_from_slice(&chunk);
        } else if seen > MAX_DRAINED_BYTES {
            break;
        }
    }
    if seen > MAX_BODY_BYTES {
        return Err(ApiError::too_large(format!(
            "the request body is over the API's limit of {} MiB: send less (a job's output \
             goes in chunks, a job spec names its image instead of carrying it)",
            MAX_BODY_BYTES / (1024 * 1024)
        )));
    }
    Ok(Bytes::from(kept))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bodies_up_to_the_limit_are_kept_whole() {
        let body = vec![7u8; MAX_BODY_BYTES];
        let read = read_body(Body::from(body.clone())).await.unwrap();
        assert_eq!(read.as_ref(), body.as_slice());
        assert!(read_body(Body::empty()).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_larger_body_is_read_to_its_end_and_refused() {
        let chunks: Vec<Result<Bytes, std::io::Error>> = (0..3)
            .map(|_| Ok(Bytes::from(vec![1u8; MAX_BODY_BYTES / 2 + 1])))
            .collect();
        let error = read_body(Body::from_stream(futures::stream::iter(chunks)))
            .await
            .unwrap_err();
        assert_eq!(error.status(), axum::http::StatusCode::PAYLOAD_TOO_LARGE);
        assert!(error.message().contains("2 MiB"), "{}", error.message());
    }
}
