//! Fuzzes the gateway's PROXY protocol v2 reader (`ongrid_gateway::proxy_protocol`: the `ppp`
//! crate's parser under the gateway's policy) with arbitrary connection openings.
//!
//! Properties: `parse` never panics; a complete header lies within the bytes and the size bound;
//! an incomplete one asks for more than it was given and no more than the bound (else
//! `read_header` would loop or over-read); `read_header` on the same bytes consumes exactly the
//! header `parse` found; an accepted header re-encodes into bytes that parse back to it; and the
//! `SignatureGuard` for untrusted peers decides as a plain prefix comparison does, however the
//! bytes are split across reads.
#![no_main]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use libfuzzer_sys::fuzz_target;
use ongrid_gateway::proxy_protocol::{
    encode, parse, read_header, Header, Parsed, SignatureGuard, FIXED_LEN, MAX_BODY_LEN, SIGNATURE,
};

/// Runs `read_header` over `bytes` (a byte slice never returns `Pending`); returns what it read
/// and how many bytes it left.
fn read_all(bytes: &[u8]) -> (Result<Header, String>, usize) {
    let mut reader = bytes;
    let result = {
        let mut future = pin!(read_header(&mut reader));
        match future
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
        {
            Poll::Ready(result) => result.map_err(|e| e.to_string()),
            Poll::Pending => panic!("read_header is pending on a byte slice"),
        }
    };
    (result, reader.len())
}

fn check_guard(data: &[u8]) {
    let expected = if data.len() >= SIGNATURE.len() {
        Some(data[..SIGNATURE.len()] == SIGNATURE)
    } else if SIGNATURE.starts_with(data) {
        None
    } else {
        Some(false)
    };
    let mut whole = SignatureGuard::default();
    assert_eq!(whole.feed(data), expected, "whole");
    // The same bytes in two reads, split where the first byte says.
    let cut = data
        .first()
        .map_or(0, |&b| usize::from(b) % (data.len() + 1));
    let mut split = SignatureGuard::default();
    let first = split.feed(&data[..cut]);
    let verdict = first.or_else(|| split.feed(&data[cut..]));
    assert_eq!(verdict, expected, "split at {cut}");
}

fuzz_target!(|data: &[u8]| {
    check_guard(data);
    let parsed = parse(data);
    let (read, left) = read_all(data);
    match parsed {
        Ok(Parsed::Complete { header, length }) => {
            assert!(length >= FIXED_LEN && length <= data.len(), "{length}");
            assert!(length - FIXED_LEN <= MAX_BODY_LEN, "{length}");
            assert_eq!(read, Ok(header), "read_header disagrees with parse");
            assert_eq!(
                left,
                data.len() - length,
                "read_header consumed other bytes"
            );
            // Only the header's own bytes are needed to decide.
            assert_eq!(parse(&data[..length]), parsed);
            let encoded = encode(&header);
            let again = parse(&encoded);
            assert_eq!(
                again,
                Ok(Parsed::Complete {
                    header,
                    length: encoded.len()
                }),
                "re-encoding {header:?}"
            );
        }
        Ok(Parsed::Incomplete { needed }) => {
            assert!(needed > data.len(), "needs {needed}, has {}", data.len());
            assert!(needed <= FIXED_LEN + MAX_BODY_LEN, "needs {needed}");
            assert!(
                read.is_err(),
                "read_header read {read:?} from an incomplete header"
            );
        }
        Err(error) => {
            let _ = error.to_string();
            // read_header refuses too (or runs out of bytes first).
            assert!(
                read.is_err(),
                "parse refused ({error}), read_header gave {read:?}"
            );
        }
    }
});
