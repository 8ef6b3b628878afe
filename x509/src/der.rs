//! A minimal DER reader for the structures x509-parser does not decode: ProxyCertInfo (RFC
//! 3820 and the GT3 draft) and VOMS attribute certificates (RFC 3281). Only definite lengths
//! and single-byte tags; every read is bounds-checked, so arbitrary input gives an error.

use std::fmt::Write as _;

pub(crate) const TAG_BOOLEAN: u8 = 0x01;
pub(crate) const TAG_INTEGER: u8 = 0x02;
pub(crate) const TAG_BIT_STRING: u8 = 0x03;
pub(crate) const TAG_OCTET_STRING: u8 = 0x04;
pub(crate) const TAG_OID: u8 = 0x06;
pub(crate) const TAG_GENERALIZED_TIME: u8 = 0x18;
pub(crate) const TAG_SEQUENCE: u8 = 0x30;
pub(crate) const TAG_SET: u8 = 0x31;

/// What is wrong with a DER encoding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DerError {
    #[error("truncated DER")]
    Truncated,
    #[error("unsupported DER length or tag encoding")]
    Unsupported,
    #[error("expected DER tag {expected:#04x}, found {found:#04x}")]
    UnexpectedTag { expected: u8, found: u8 },
    #[error("unexpected data after the DER value")]
    TrailingData,
    #[error("malformed DER value: {0}")]
    Malformed(&'static str),
}

/// One tag-length-value: `raw` is the whole encoding, `value` its contents.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tlv<'a> {
    pub tag: u8,
    pub value: &'a [u8],
    pub raw: &'a [u8],
}

impl<'a> Tlv<'a> {
    /// A reader over the contents of this (constructed) value.
    pub fn reader(&self) -> Reader<'a> {
        Reader::new(self.value)
    }
}

/// Reads consecutive TLVs from a byte slice.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn peek_tag(&self) -> Option<u8> {
        self.data.first().copied()
    }

    pub fn read(&mut self) -> Result<Tlv<'a>, DerError> {
        let data = self.data;
        let (&tag, rest) = data.split_first().ok_or(DerError::Truncated)?;
        if tag & 0x1f == 0x1f {
            return Err(DerError::Unsupported);
        }
        let (&first, mut rest) = rest.split_first().ok_or(DerError::Truncated)?;
        let len = if first < 0x80 {
            usize::from(first)
        } else {
            let count = usize::from(first & 0x7f);
            if count == 0 || count > 4 {
                return Err(DerError::Unsupported);
            }
            if rest.len() < count {
                return Err(DerError::Truncated);
            }
            let (bytes, after) = rest.split_at(count);
            rest = after;
            bytes
                .iter()
                .fold(0usize, |acc, b| (acc << 8) | usize::from(*b))
        };
        if rest.len() < len {
            return Err(DerError::Truncated);
        }
        let header = data.len() - rest.len();
        let (value, after) = rest.split_at(len);
        self.data = after;
        Ok(Tlv {
            tag,
            value,
            raw: &data[..header + len],
        })
    }

    /// Reads one TLV that must have tag `expected`.
    pub fn expect(&mut self, expected: u8) -> Result<Tlv<'a>, DerError> {
        let tlv = self.read()?;
        if tlv.tag != expected {
            return Err(DerError::UnexpectedTag {
                expected,
                found: tlv.tag,
            });
        }
        Ok(tlv)
    }

    /// Reads a TLV with tag `tag` if the next one has it.
    pub fn optional(&mut self, tag: u8) -> Result<Option<Tlv<'a>>, DerError> {
        if self.peek_tag() == Some(tag) {
            self.read().map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn finish(&self) -> Result<(), DerError> {
        if self.data.is_empty() {
            Ok(())
        } else {
            Err(DerError::TrailingData)
        }
    }
}

/// Parses exactly one TLV with tag `tag` from `data`.
pub(crate) fn single(data: &[u8], tag: u8) -> Result<Tlv<'_>, DerError> {
    let mut reader = Reader::new(data);
    let tlv = reader.expect(tag)?;
    reader.finish()?;
    Ok(tlv)
}

/// The dotted form of an OBJECT IDENTIFIER's contents, like `1.3.6.1.5.5.7.1.14`.
pub(crate) fn oid_string(bytes: &[u8]) -> Result<String, DerError> {
    if bytes.is_empty() || bytes.last().is_some_and(|b| b & 0x80 != 0) {
        return Err(DerError::Malformed("object identifier"));
    }
    let mut out = String::new();
    let mut value: u64 = 0;
    let mut first = true;
    for &b in bytes {
        if value > (u64::MAX >> 7) {
            return Err(DerError::Malformed("object identifier arc too large"));
        }
        value = (value << 7) | u64::from(b & 0x7f);
        if b & 0x80 == 0 {
            if first {
                let (a, b) = match value {
                    0..=39 => (0, value),
                    40..=79 => (1, value - 40),
                    _ => (2, value - 80),
                };
                let _ = write!(out, "{a}.{b}");
                first = false;
            } else {
                let _ = write!(out, ".{value}");
            }
            value = 0;
        }
    }
    Ok(out)
}

/// A non-negative INTEGER's value if it fits in a u64.
pub(crate) fn small_uint(bytes: &[u8]) -> Result<u64, DerError> {
    if bytes.is_empty() || bytes[0] & 0x80 != 0 {
        return Err(DerError::Malformed("integer must be non-negative"));
    }
    let trimmed = strip_leading_zeros(bytes);
    if trimmed.len() > 8 {
        return Err(DerError::Malformed("integer too large"));
    }
    Ok(trimmed
        .iter()
        .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
}

/// An INTEGER's magnitude bytes without leading zero octets (for comparing serials).
pub(crate) fn strip_leading_zeros(bytes: &[u8]) -> &[u8] {
    let start = bytes.iter().position(|b| *b != 0).unwrap_or(bytes.len());
    &bytes[start..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oids_in_dotted_form() {
        // 1.3.6.1.5.5.7.1.14
        assert_eq!(
            oid_string(&[0x2b, 6, 1, 5, 5, 7, 1, 14]).unwrap(),
            "1.3.6.1.5.5.7.1.14"
        );
        // 1.3.6.1.4.1.8005.100.100.5
        assert_eq!(
            oid_string(&[0x2b, 6, 1, 4, 1, 0xbe, 0x45, 0x64, 0x64, 0x05]).unwrap(),
            "1.3.6.1.4.1.8005.100.100.5"
        );
        assert!(oid_string(&[0x2b, 0x86]).is_err());
        assert!(oid_string(&[]).is_err());
    }

    #[test]
    fn lengths_are_bounds_checked() {
        assert_eq!(
            Reader::new(&[0x30, 0x05, 1]).read().unwrap_err(),
            DerError::Truncated
        );
        assert_eq!(
            Reader::new(&[0x30, 0x80]).read().unwrap_err(),
            DerError::Unsupported
        );
        assert_eq!(
            Reader::new(&[0x30, 0x82, 0x01]).read().unwrap_err(),
            DerError::Truncated
        );
        let tlv = single(&[0x30, 0x81, 0x02, 5, 6], TAG_SEQUENCE).unwrap();
        assert_eq!(tlv.value, &[5, 6]);
        assert_eq!(tlv.raw.len(), 5);
        assert_eq!(
            single(&[0x02, 0x01, 0x01, 0x00], TAG_INTEGER).unwrap_err(),
            DerError::TrailingData
        );
    }

    #[test]
    fn small_integers() {
        assert_eq!(small_uint(&[0x00, 0x80]).unwrap(), 128);
        assert_eq!(small_uint(&[0x02]).unwrap(), 2);
        assert!(small_uint(&[0xff]).is_err());
    }
}
