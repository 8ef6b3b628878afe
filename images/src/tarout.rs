//! A small streaming tar writer for the filtered filesystem that goes to `tar2sqfs`: ustar
//! headers, plus a PAX extended header when a path or link target does not fit (over 100 bytes),
//! a number does not fit its octal field, or the entry carries extended attributes. Names are
//! raw bytes (non-ASCII and non-UTF-8 names pass through unchanged).

use std::io::{self, Read, Write};

use tar::{EntryType, Header};

const BLOCK: usize = 512;
/// Largest value of a 12-byte octal field (size, mtime).
const MAX_OCTAL_12: u64 = 0o77_777_777_777;
/// Largest value of an 8-byte octal field (uid, gid, mode).
const MAX_OCTAL_8: u64 = 0o7_777_777;

/// Everything about one entry except its data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EntryMeta {
    pub path: Vec<u8>,
    pub kind: EntryType,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    pub mtime: u64,
    pub size: u64,
    pub link: Option<Vec<u8>>,
    pub device: Option<(u32, u32)>,
    /// PAX records carried over unchanged (`SCHILY.xattr.*`, `LIBARCHIVE.xattr.*`).
    pub xattrs: Vec<(String, Vec<u8>)>,
}

pub(crate) struct TarWriter<W: Write> {
    out: W,
    buf: Vec<u8>,
}

impl<W: Write> TarWriter<W> {
    pub fn new(out: W) -> Self {
        Self {
            out,
            buf: vec![0; 256 * 1024],
        }
    }

    /// Writes the header(s) of `meta`, then exactly `meta.size` bytes from `data`, then padding.
    /// `between_chunks` runs before every chunk of data (the cancel check); its error aborts.
    pub fn append<E>(
        &mut self,
        meta: &EntryMeta,
        data: &mut dyn Read,
        between_chunks: &mut dyn FnMut() -> Result<(), E>,
    ) -> Result<(), AppendError<E>> {
        self.write_headers(meta).map_err(AppendError::Write)?;
        let mut left = meta.size;
        while left > 0 {
            between_chunks().map_err(AppendError::Stopped)?;
            let want = usize::try_from(left.min(self.buf.len() as u64)).unwrap_or(self.buf.len());
            let got = match data.read(&mut self.buf[..want]) {
                Ok(0) => return Err(AppendError::ShortData { missing: left }),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(AppendError::Read(e)),
            };
            self.out
                .write_all(&self.buf[..got])
                .map_err(AppendError::Write)?;
            left -= got as u64;
        }
        self.pad(meta.size).map_err(AppendError::Write)
    }

    /// The inner writer.
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.out
    }

    /// Writes the end-of-archive marker, flushes and returns the inner writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.out.write_all(&[0; 2 * BLOCK])?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn write_headers(&mut self, meta: &EntryMeta) -> io::Result<()> {
        let mut pax = Vec::new();
        if meta.path.len() > 100 {
            pax_record(&mut pax, "path", &meta.path);
        }
        if let Some(link) = &meta.link {
            if link.len() > 100 {
                pax_record(&mut pax, "linkpath", link);
            }
        }
        if meta.size > MAX_OCTAL_12 {
            pax_record(&mut pax, "size", meta.size.to_string().as_bytes());
        }
        if meta.mtime > MAX_OCTAL_12 {
            pax_record(&mut pax, "mtime", meta.mtime.to_string().as_bytes());
        }
        if meta.uid > MAX_OCTAL_8 {
            pax_record(&mut pax, "uid", meta.uid.to_string().as_bytes());
        }
        if meta.gid > MAX_OCTAL_8 {
            pax_record(&mut pax, "gid", meta.gid.to_string().as_bytes());
        }
        for (key, value) in &meta.xattrs {
            pax_record(&mut pax, key, value);
        }
        if !pax.is_empty() {
            let mut header = Header::new_ustar();
            set_name(&mut header, b"././@PaxHeader");
            header.set_mode(0o644);
            header.set_size(pax.len() as u64);
            header.set_entry_type(EntryType::XHeader);
            header.set_cksum();
            self.out.write_all(header.as_bytes())?;
            self.out.write_all(&pax)?;
            self.pad(pax.len() as u64)?;
        }

        let mut header = Header::new_ustar();
        set_name(&mut header, &meta.path);
        header.set_entry_type(meta.kind);
        header.set_mode(meta.mode & 0o7777);
        // Numbers too large for octal also went into the PAX header above; tar's own setters fall
        // back to GNU base-256 in the ustar field, which readers ignore when PAX is present.
        header.set_uid(meta.uid);
        header.set_gid(meta.gid);
        header.set_mtime(meta.mtime);
        header.set_size(meta.size);
        if let Some(link) = &meta.link {
            let field = &mut header.as_old_mut().linkname;
            let n = link.len().min(field.len());
            field[..n].copy_from_slice(&link[..n]);
        }
        if let Some((major, minor)) = meta.device {
            header.set_device_major(major)?;
            header.set_device_minor(minor)?;
        }
        header.set_cksum();
        self.out.write_all(header.as_bytes())
    }

    fn pad(&mut self, size: u64) -> io::Result<()> {
        let rem = (size % BLOCK as u64) as usize;
        if rem != 0 {
            self.out.write_all(&[0; BLOCK][..BLOCK - rem])?;
        }
        Ok(())
    }
}

#[derive(Debug)]
pub(crate) enum AppendError<E> {
    /// Writing to the output failed.
    Write(io::Error),
    /// Reading the entry's data failed.
    Read(io::Error),
    /// The data ended before `size` bytes.
    ShortData { missing: u64 },
    /// `between_chunks` said stop.
    Stopped(E),
}

/// Puts as much of `name` as fits into the 100-byte name field (the PAX `path` has the rest).
fn set_name(header: &mut Header, name: &[u8]) {
    let field = &mut header.as_old_mut().name;
    let n = name.len().min(field.len());
    field[..n].copy_from_slice(&name[..n]);
}

/// One PAX record: `"<len> <key>=<value>\n"`, where `<len>` counts the whole record.
fn pax_record(out: &mut Vec<u8>, key: &str, value: &[u8]) {
    let rest = 1 + key.len() + 1 + value.len() + 1; // ' ' key '=' value '\n'
    let mut len = rest + 1;
    while len != rest + len.to_string().len() {
        len = rest + len.to_string().len();
    }
    out.extend_from_slice(len.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(key.as_bytes());
    out.push(b'=');
    out.extend_from_slice(value);
    out.push(b'\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(path: &[u8], kind: EntryType, size: u64) -> EntryMeta {
        EntryMeta {
            path: path.to_vec(),
            kind,
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime: 1_700_000_000,
            size,
            link: None,
            device: None,
            xattrs: Vec::new(),
        }
    }

    #[test]
    fn pax_record_lengths_count_themselves() {
        for value_len in [0, 1, 5, 6, 7, 90, 95, 96, 97, 98, 99, 100, 990, 995, 1000] {
            let mut out = Vec::new();
            pax_record(&mut out, "path", &vec![b'a'; value_len]);
            let text = String::from_utf8(out.clone()).expect("ascii");
            let (len, _) = text.split_once(' ').expect("space");
            assert_eq!(len.parse::<usize>().expect("number"), out.len(), "{text:?}");
        }
    }

    #[test]
    fn round_trips_through_the_tar_crate() {
        let long: Vec<u8> = "d/"
            .repeat(80)
            .into_bytes()
            .into_iter()
            .chain(*b"f")
            .collect();
        let mut big_uid = meta("données-ü.txt".as_bytes(), EntryType::Regular, 3);
        big_uid.uid = 5_000_000;
        big_uid.gid = 1000;
        big_uid.mode = 0o4755;
        big_uid.xattrs = vec![("SCHILY.xattr.user.k".into(), b"v\0w".to_vec())];
        let mut link = meta(b"l", EntryType::Symlink, 0);
        link.link = Some(long.clone());
        let mut out = TarWriter::new(Vec::new());
        let mut ok = || Ok::<(), ()>(());
        out.append(&big_uid, &mut &b"abc"[..], &mut ok)
            .expect("append");
        out.append(
            &meta(&long, EntryType::Regular, 0),
            &mut io::empty(),
            &mut ok,
        )
        .expect("append");
        out.append(&link, &mut io::empty(), &mut ok)
            .expect("append");
        let bytes = out.finish().expect("finish");

        let mut archive = tar::Archive::new(&bytes[..]);
        let mut entries = archive.entries().expect("entries");
        let mut first = entries.next().expect("one").expect("ok");
        assert_eq!(&*first.path_bytes(), "données-ü.txt".as_bytes());
        assert_eq!(first.header().uid().expect("uid"), 5_000_000);
        assert_eq!(first.header().mode().expect("mode"), 0o4755);
        let xattr: Vec<(String, Vec<u8>)> = first
            .pax_extensions()
            .expect("pax")
            .expect("some")
            .map(|e| {
                let e = e.expect("record");
                (e.key().expect("key").to_string(), e.value_bytes().to_vec())
            })
            .filter(|(k, _)| k.starts_with("SCHILY"))
            .collect();
        assert_eq!(
            xattr,
            vec![("SCHILY.xattr.user.k".into(), b"v\0w".to_vec())]
        );
        let mut data = Vec::new();
        first.read_to_end(&mut data).expect("data");
        assert_eq!(data, b"abc");
        let second = entries.next().expect("two").expect("ok");
        assert_eq!(&*second.path_bytes(), &long[..]);
        let third = entries.next().expect("three").expect("ok");
        assert_eq!(&*third.link_name_bytes().expect("link"), &long[..]);
        assert!(entries.next().is_none());
    }

    #[test]
    fn short_data_is_an_error() {
        let mut out = TarWriter::new(Vec::new());
        let err = out
            .append(
                &meta(b"f", EntryType::Regular, 10),
                &mut &b"abc"[..],
                &mut || Ok::<(), ()>(()),
            )
            .expect_err("short");
        assert!(matches!(err, AppendError::ShortData { missing: 7 }));
    }
}
