//! The Singularity Image Format (SIF, version "01"), as sylabs/sif `pkg/sif` defines it and
//! Apptainer reads it: a 128-byte global header, a table of 48 fixed-size (585-byte) object
//! descriptors at offset 4096, then the data objects. Everything little-endian and packed.
//!
//! [`Layout`] computes the header, descriptors and small objects of a new image (the writer;
//! the caller streams the squashfs partition after [`Layout::prefix`]); [`SifImage::read`]
//! parses an image and checks the format's invariants (the reader, used by tests and by
//! `devctl image show`).

use std::io::{self, Read, Seek, SeekFrom};

pub const LAUNCH_SCRIPT: &str = "#!/usr/bin/env run-singularity\n";
pub const MAGIC: &[u8; 10] = b"SIF_MAGIC\0";
pub const VERSION: &[u8; 3] = b"01\0";
pub const HEADER_SIZE: u64 = 128;
pub const DESCRIPTOR_SIZE: u64 = 585;
pub const DESCRIPTORS_TOTAL: u64 = 48;
pub const DESCRIPTORS_OFFSET: u64 = 4096;
pub const DATA_OFFSET: u64 = DESCRIPTORS_OFFSET + DESCRIPTORS_TOTAL * DESCRIPTOR_SIZE;
/// Partitions start on this boundary (sylabs/sif aligns them to the page size).
pub const PARTITION_ALIGN: u64 = 4096;
/// All objects in group 1, as Apptainer's build does.
pub const GROUP_ID: u32 = 0xf000_0001;
/// Objects [`SifImage::object_data`] reads into memory at most.
pub const MAX_OBJECT_READ: u64 = 16 * 1024 * 1024;

const NAME_LEN: usize = 128;
const EXTRA_LEN: usize = 384;

#[derive(Debug, thiserror::Error)]
pub enum SifError {
    #[error("reading the SIF file: {0}")]
    Io(#[from] io::Error),
    #[error("not a SIF image: {0}")]
    Invalid(String),
    #[error("cannot lay out the SIF image: {0}")]
    Layout(String),
}

/// Data object types (`DataType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataType {
    Deffile,
    EnvVar,
    Labels,
    Partition,
    Signature,
    GenericJson,
    Generic,
    CryptoMessage,
    Sbom,
    OciRootIndex,
    OciBlob,
    Unknown(i32),
}

impl DataType {
    pub fn code(self) -> i32 {
        match self {
            Self::Deffile => 0x4001,
            Self::EnvVar => 0x4002,
            Self::Labels => 0x4003,
            Self::Partition => 0x4004,
            Self::Signature => 0x4005,
            Self::GenericJson => 0x4006,
            Self::Generic => 0x4007,
            Self::CryptoMessage => 0x4008,
            Self::Sbom => 0x4009,
            Self::OciRootIndex => 0x400a,
            Self::OciBlob => 0x400b,
            Self::Unknown(code) => code,
        }
    }

    pub fn from_code(code: i32) -> Self {
        [
            Self::Deffile,
            Self::EnvVar,
            Self::Labels,
            Self::Partition,
            Self::Signature,
            Self::GenericJson,
            Self::Generic,
            Self::CryptoMessage,
            Self::Sbom,
            Self::OciRootIndex,
            Self::OciBlob,
        ]
        .into_iter()
        .find(|t| t.code() == code)
        .unwrap_or(Self::Unknown(code))
    }
}

/// Filesystem of a partition (`FSType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsType {
    Squashfs,
    Ext3,
    ImmutableObject,
    Raw,
    EncryptedSquashfs,
    Unknown(i32),
}

impl FsType {
    pub fn code(self) -> i32 {
        match self {
            Self::Squashfs => 1,
            Self::Ext3 => 2,
            Self::ImmutableObject => 3,
            Self::Raw => 4,
            Self::EncryptedSquashfs => 5,
            Self::Unknown(code) => code,
        }
    }

    fn from_code(code: i32) -> Self {
        match code {
            1 => Self::Squashfs,
            2 => Self::Ext3,
            3 => Self::ImmutableObject,
            4 => Self::Raw,
            5 => Self::EncryptedSquashfs,
            other => Self::Unknown(other),
        }
    }
}

/// Role of a partition (`PartType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartType {
    System,
    PrimarySystem,
    Data,
    Overlay,
    Unknown(i32),
}

impl PartType {
    pub fn code(self) -> i32 {
        match self {
            Self::System => 1,
            Self::PrimarySystem => 2,
            Self::Data => 3,
            Self::Overlay => 4,
            Self::Unknown(code) => code,
        }
    }

    fn from_code(code: i32) -> Self {
        match code {
            1 => Self::System,
            2 => Self::PrimarySystem,
            3 => Self::Data,
            4 => Self::Overlay,
            other => Self::Unknown(other),
        }
    }
}

/// SIF's two-digit architecture code of amd64.
pub const ARCH_AMD64: [u8; 2] = *b"02";

/// Partition metadata (the descriptor's `Extra` for partitions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionInfo {
    pub fs_type: FsType,
    pub part_type: PartType,
    /// Two ASCII digits, e.g. `02` for amd64.
    pub arch: [u8; 2],
}

/// The global header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub launch_script: String,
    pub version: String,
    /// Two ASCII digits of the primary partition's architecture (`00` when none).
    pub arch: [u8; 2],
    pub id: uuid::Uuid,
    pub created_at: i64,
    pub modified_at: i64,
    pub descriptors_free: i64,
    pub descriptors_total: i64,
    pub descriptors_offset: i64,
    pub descriptors_size: i64,
    pub data_offset: i64,
    pub data_size: i64,
}

/// One used object descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub data_type: DataType,
    pub id: u32,
    pub group_id: u32,
    pub linked_id: u32,
    pub offset: i64,
    pub size: i64,
    pub size_with_padding: i64,
    pub created_at: i64,
    pub modified_at: i64,
    pub name: String,
    /// Set for [`DataType::Partition`].
    pub partition: Option<PartitionInfo>,
}

/// A small object stored inline (definition file, JSON metadata).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InlineObject {
    pub data_type: DataType,
    pub name: String,
    pub data: Vec<u8>,
}

/// Where every byte of a new image goes: `prefix` (header, descriptor table, the inline
/// objects and the padding before the partition), then `partition_len` bytes of partition.
#[derive(Debug, Clone)]
pub struct Layout {
    pub prefix: Vec<u8>,
    pub partition_offset: u64,
    pub total_len: u64,
}

impl Layout {
    /// Lays out `objects` (in order, unaligned, as Apptainer writes them) followed by one
    /// primary-system partition of `partition_len` bytes aligned to [`PARTITION_ALIGN`].
    pub fn new(
        objects: &[InlineObject],
        partition: PartitionInfo,
        partition_len: u64,
        id: uuid::Uuid,
        created_at: i64,
    ) -> Result<Layout, SifError> {
        let used = objects.len() as u64 + 1;
        if used > DESCRIPTORS_TOTAL {
            return Err(SifError::Layout(format!(
                "{used} objects, at most {DESCRIPTORS_TOTAL}"
            )));
        }
        let mut descriptors = Vec::with_capacity(objects.len() + 1);
        let mut data = Vec::new();
        let mut offset = DATA_OFFSET;
        for (index, object) in objects.iter().enumerate() {
            let size = object.data.len() as u64;
            descriptors.push(encode_descriptor(&RawDescriptor {
                data_type: object.data_type.code(),
                id: index as u32 + 1,
                offset,
                size,
                size_with_padding: size,
                created_at,
                name: &object.name,
                extra: [0; EXTRA_LEN],
            })?);
            data.extend_from_slice(&object.data);
            offset += size;
        }
        let partition_offset = offset.div_ceil(PARTITION_ALIGN) * PARTITION_ALIGN;
        let mut extra = [0u8; EXTRA_LEN];
        extra[0..4].copy_from_slice(&partition.fs_type.code().to_le_bytes());
        extra[4..8].copy_from_slice(&partition.part_type.code().to_le_bytes());
        extra[8..10].copy_from_slice(&partition.arch);
        descriptors.push(encode_descriptor(&RawDescriptor {
            data_type: DataType::Partition.code(),
            id: objects.len() as u32 + 1,
            offset: partition_offset,
            size: partition_len,
            size_with_padding: partition_len + (partition_offset - offset),
            created_at,
            name: "",
            extra,
        })?);
        let total_len = partition_offset + partition_len;

        let mut prefix = Vec::with_capacity(partition_offset as usize);
        let mut launch = [0u8; 32];
        launch[..LAUNCH_SCRIPT.len()].copy_from_slice(LAUNCH_SCRIPT.as_bytes());
        prefix.extend_from_slice(&launch);
        prefix.extend_from_slice(MAGIC);
        prefix.extend_from_slice(VERSION);
        prefix.extend_from_slice(&[partition.arch[0], partition.arch[1], 0]);
        prefix.extend_from_slice(id.as_bytes());
        for value in [
            created_at,
            created_at,
            (DESCRIPTORS_TOTAL - used) as i64,
            DESCRIPTORS_TOTAL as i64,
            DESCRIPTORS_OFFSET as i64,
            (DESCRIPTORS_TOTAL * DESCRIPTOR_SIZE) as i64,
            DATA_OFFSET as i64,
            (total_len - DATA_OFFSET) as i64,
        ] {
            prefix.extend_from_slice(&value.to_le_bytes());
        }
        debug_assert_eq!(prefix.len() as u64, HEADER_SIZE);
        prefix.resize(DESCRIPTORS_OFFSET as usize, 0);
        for descriptor in &descriptors {
            prefix.extend_from_slice(descriptor);
        }
        prefix.resize(DATA_OFFSET as usize, 0);
        prefix.extend_from_slice(&data);
        prefix.resize(partition_offset as usize, 0);
        Ok(Layout {
            prefix,
            partition_offset,
            total_len,
        })
    }
}

struct RawDescriptor<'a> {
    data_type: i32,
    id: u32,
    offset: u64,
    size: u64,
    size_with_padding: u64,
    created_at: i64,
    name: &'a str,
    extra: [u8; EXTRA_LEN],
}

fn encode_descriptor(d: &RawDescriptor<'_>) -> Result<Vec<u8>, SifError> {
    if d.name.len() >= NAME_LEN {
        return Err(SifError::Layout(format!(
            "object name {:?} longer than {} bytes",
            d.name,
            NAME_LEN - 1
        )));
    }
    let mut out = Vec::with_capacity(DESCRIPTOR_SIZE as usize);
    out.extend_from_slice(&d.data_type.to_le_bytes());
    out.push(1); // used
    out.extend_from_slice(&d.id.to_le_bytes());
    out.extend_from_slice(&GROUP_ID.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes()); // linked id
    for value in [
        d.offset as i64,
        d.size as i64,
        d.size_with_padding as i64,
        d.created_at,
        d.created_at,
        0, // uid (deprecated)
        0, // gid (deprecated)
    ] {
        out.extend_from_slice(&value.to_le_bytes());
    }
    let mut name = [0u8; NAME_LEN];
    name[..d.name.len()].copy_from_slice(d.name.as_bytes());
    out.extend_from_slice(&name);
    out.extend_from_slice(&d.extra);
    debug_assert_eq!(out.len() as u64, DESCRIPTOR_SIZE);
    Ok(out)
}

/// A parsed image: its header and used descriptors (in table order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SifImage {
    pub header: Header,
    pub descriptors: Vec<Descriptor>,
    pub file_len: u64,
}

impl SifImage {
    /// Parses the header and descriptor table and checks the format's invariants: magic and
    /// version, table geometry (`size == total × 585`, data right after the table), every
    /// object inside the data section and the file, the free count, at most one primary
    /// partition whose arch the header repeats, partitions aligned to 4096, and a squashfs
    /// partition starting with a squashfs 4.0 superblock whose `bytes_used` fits.
    pub fn read<R: Read + Seek>(file: &mut R) -> Result<SifImage, SifError> {
        let file_len = file.seek(SeekFrom::End(0))?;
        file.seek(SeekFrom::Start(0))?;
        let mut raw = [0u8; HEADER_SIZE as usize];
        file.read_exact(&mut raw)
            .map_err(|_| invalid("shorter than the 128-byte header"))?;
        if &raw[32..42] != MAGIC {
            return Err(invalid("no SIF_MAGIC at offset 32"));
        }
        if &raw[42..45] != VERSION {
            return Err(invalid(format!(
                "version {:?}, only \"01\" is supported",
                String::from_utf8_lossy(&raw[42..44])
            )));
        }
        let int = |at: usize| i64::from_le_bytes(le8(&raw[at..at + 8]));
        let header = Header {
            launch_script: c_string(&raw[0..32]),
            version: c_string(&raw[42..45]),
            arch: [raw[45], raw[46]],
            id: uuid::Uuid::from_bytes(le16(&raw[48..64])),
            created_at: int(64),
            modified_at: int(72),
            descriptors_free: int(80),
            descriptors_total: int(88),
            descriptors_offset: int(96),
            descriptors_size: int(104),
            data_offset: int(112),
            data_size: int(120),
        };
        let total = u64::try_from(header.descriptors_total)
            .ok()
            .filter(|t| (1..=4096).contains(t))
            .ok_or_else(|| invalid(format!("{} descriptors", header.descriptors_total)))?;
        if header.descriptors_size != (total * DESCRIPTOR_SIZE) as i64 {
            return Err(invalid(format!(
                "descriptor table is {} bytes, {} descriptors need {}",
                header.descriptors_size,
                total,
                total * DESCRIPTOR_SIZE
            )));
        }
        if header.data_offset != header.descriptors_offset + header.descriptors_size {
            return Err(invalid(
                "data does not start right after the descriptor table",
            ));
        }
        let data_offset =
            u64::try_from(header.data_offset).map_err(|_| invalid("negative data offset"))?;
        if data_offset > file_len {
            return Err(invalid("descriptor table runs past the end of the file"));
        }
        file.seek(SeekFrom::Start(header.descriptors_offset as u64))?;
        let mut table = vec![0u8; (total * DESCRIPTOR_SIZE) as usize];
        file.read_exact(&mut table)?;

        let mut descriptors = Vec::new();
        for raw in table.chunks_exact(DESCRIPTOR_SIZE as usize) {
            if raw[4] == 0 {
                continue;
            }
            let u32_at = |at: usize| u32::from_le_bytes(le4(&raw[at..at + 4]));
            let i64_at = |at: usize| i64::from_le_bytes(le8(&raw[at..at + 8]));
            let data_type = DataType::from_code(i32::from_le_bytes(le4(&raw[0..4])));
            let extra = &raw[201..201 + EXTRA_LEN];
            let partition = (data_type == DataType::Partition).then(|| PartitionInfo {
                fs_type: FsType::from_code(i32::from_le_bytes(le4(&extra[0..4]))),
                part_type: PartType::from_code(i32::from_le_bytes(le4(&extra[4..8]))),
                arch: [extra[8], extra[9]],
            });
            descriptors.push(Descriptor {
                data_type,
                id: u32_at(5),
                group_id: u32_at(9),
                linked_id: u32_at(13),
                offset: i64_at(17),
                size: i64_at(25),
                size_with_padding: i64_at(33),
                created_at: i64_at(41),
                modified_at: i64_at(49),
                name: c_string(&raw[73..73 + NAME_LEN]),
                partition,
            });
        }
        let image = SifImage {
            header,
            descriptors,
            file_len,
        };
        image.check(file)?;
        Ok(image)
    }

    /// Opens and reads the image at `path`.
    pub fn read_path(path: &std::path::Path) -> Result<SifImage, SifError> {
        SifImage::read(&mut std::fs::File::open(path)?)
    }

    fn check<R: Read + Seek>(&self, file: &mut R) -> Result<(), SifError> {
        let h = &self.header;
        let used = self.descriptors.len() as i64;
        if h.descriptors_free != h.descriptors_total - used {
            return Err(invalid(format!(
                "header says {} descriptors free, {} of {} are used",
                h.descriptors_free, used, h.descriptors_total
            )));
        }
        for d in &self.descriptors {
            let end = d.offset.checked_add(d.size);
            if d.offset < h.data_offset
                || d.size < 0
                || end.is_none_or(|e| e as u64 > self.file_len)
            {
                return Err(invalid(format!(
                    "object {} ({} bytes at {}) lies outside the data section",
                    d.id, d.size, d.offset
                )));
            }
        }
        let primaries: Vec<&Descriptor> = self
            .descriptors
            .iter()
            .filter(|d| {
                d.partition
                    .is_some_and(|p| p.part_type == PartType::PrimarySystem)
            })
            .collect();
        if primaries.len() > 1 {
            return Err(invalid("more than one primary system partition"));
        }
        if let Some(primary) = primaries.first() {
            let arch = primary.partition.map(|p| p.arch);
            if arch != Some(h.arch) {
                return Err(invalid(
                    "header architecture differs from the primary partition's",
                ));
            }
        }
        for d in &self.descriptors {
            let Some(partition) = d.partition else {
                continue;
            };
            if (d.offset as u64) & (PARTITION_ALIGN - 1) != 0 {
                return Err(invalid(format!(
                    "partition {} at offset {} is not aligned to {PARTITION_ALIGN}",
                    d.id, d.offset
                )));
            }
            if partition.fs_type == FsType::Squashfs {
                let mut superblock = [0u8; 48];
                file.seek(SeekFrom::Start(d.offset as u64))?;
                file.read_exact(&mut superblock)
                    .map_err(|_| invalid("squashfs partition shorter than its superblock"))?;
                if &superblock[0..4] != b"hsqs" {
                    return Err(invalid(format!("partition {} is not squashfs", d.id)));
                }
                let major = u16::from_le_bytes([superblock[28], superblock[29]]);
                let minor = u16::from_le_bytes([superblock[30], superblock[31]]);
                if (major, minor) != (4, 0) {
                    return Err(invalid(format!(
                        "squashfs version {major}.{minor}, want 4.0"
                    )));
                }
                let bytes_used = u64::from_le_bytes(le8(&superblock[40..48]));
                if bytes_used > d.size as u64 {
                    return Err(invalid(format!(
                        "squashfs uses {bytes_used} bytes, its partition has {}",
                        d.size
                    )));
                }
            }
        }
        Ok(())
    }

    /// The primary system partition, if any.
    pub fn primary_partition(&self) -> Option<&Descriptor> {
        self.descriptors.iter().find(|d| {
            d.partition
                .is_some_and(|p| p.part_type == PartType::PrimarySystem)
        })
    }

    /// The first object of `data_type` (and `name`, when given).
    pub fn find(&self, data_type: DataType, name: Option<&str>) -> Option<&Descriptor> {
        self.descriptors
            .iter()
            .find(|d| d.data_type == data_type && name.is_none_or(|n| d.name == n))
    }

    /// Reads a small object's bytes (at most [`MAX_OBJECT_READ`]).
    pub fn object_data<R: Read + Seek>(
        &self,
        file: &mut R,
        descriptor: &Descriptor,
    ) -> Result<Vec<u8>, SifError> {
        let size = descriptor.size as u64;
        if size > MAX_OBJECT_READ {
            return Err(invalid(format!(
                "object {} is {size} bytes, too large to read into memory",
                descriptor.id
            )));
        }
        file.seek(SeekFrom::Start(descriptor.offset as u64))?;
        let mut data = vec![0u8; size as usize];
        file.read_exact(&mut data)?;
        Ok(data)
    }
}

fn invalid(message: impl Into<String>) -> SifError {
    SifError::Invalid(message.into())
}

fn c_string(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

fn le4(bytes: &[u8]) -> [u8; 4] {
    let mut out = [0; 4];
    out.copy_from_slice(bytes);
    out
}

fn le8(bytes: &[u8]) -> [u8; 8] {
    let mut out = [0; 8];
    out.copy_from_slice(bytes);
    out
}

fn le16(bytes: &[u8]) -> [u8; 16] {
    let mut out = [0; 16];
    out.copy_from_slice(bytes);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    /// A fake squashfs partition: a superblock with magic, version 4.0 and `bytes_used`.
    fn fake_squashfs(len: usize) -> Vec<u8> {
        let mut data = vec![0xab; len];
        data[0..4].copy_from_slice(b"hsqs");
        data[28..30].copy_from_slice(&4u16.to_le_bytes());
        data[30..32].copy_from_slice(&0u16.to_le_bytes());
        data[40..48].copy_from_slice(&(len as u64).to_le_bytes());
        data
    }

    fn objects() -> Vec<InlineObject> {
        vec![
            InlineObject {
                data_type: DataType::Deffile,
                name: String::new(),
                data: b"bootstrap: docker-daemon\nfrom: x\n".to_vec(),
            },
            InlineObject {
                data_type: DataType::GenericJson,
                name: "ongrid-provenance.json".into(),
                data: br#"{"a":1}"#.to_vec(),
            },
        ]
    }

    fn image(partition: &[u8]) -> (Layout, Vec<u8>) {
        let layout = Layout::new(
            &objects(),
            PartitionInfo {
                fs_type: FsType::Squashfs,
                part_type: PartType::PrimarySystem,
                arch: ARCH_AMD64,
            },
            partition.len() as u64,
            uuid::Uuid::from_u128(0x1234),
            1_700_000_000,
        )
        .expect("layout");
        let mut bytes = layout.prefix.clone();
        bytes.extend_from_slice(partition);
        (layout, bytes)
    }

    #[test]
    fn written_images_read_back() {
        let partition = fake_squashfs(10_000);
        let (layout, bytes) = image(&partition);
        assert_eq!(layout.partition_offset, 32768);
        assert_eq!(layout.total_len, bytes.len() as u64);
        let sif = SifImage::read(&mut Cursor::new(&bytes)).expect("valid");
        assert_eq!(sif.header.launch_script, LAUNCH_SCRIPT);
        assert_eq!(sif.header.version, "01");
        assert_eq!(sif.header.arch, ARCH_AMD64);
        assert_eq!(sif.header.id, uuid::Uuid::from_u128(0x1234));
        assert_eq!(sif.header.descriptors_free, 45);
        assert_eq!(sif.header.data_offset, 32176);
        assert_eq!(sif.header.data_size, bytes.len() as i64 - 32176);
        let kinds: Vec<_> = sif
            .descriptors
            .iter()
            .map(|d| (d.id, d.data_type))
            .collect();
        assert_eq!(
            kinds,
            vec![
                (1, DataType::Deffile),
                (2, DataType::GenericJson),
                (3, DataType::Partition)
            ]
        );
        assert_eq!(sif.descriptors[0].offset, 32176);
        let json = sif
            .find(DataType::GenericJson, Some("ongrid-provenance.json"))
            .expect("json");
        assert_eq!(
            sif.object_data(&mut Cursor::new(&bytes), json)
                .expect("data"),
            br#"{"a":1}"#
        );
        let primary = sif.primary_partition().expect("primary");
        assert_eq!(primary.offset, 32768);
        assert_eq!(primary.size, 10_000);
        assert_eq!(primary.size_with_padding, 10_000 + 32768 - 32176 - 33 - 7);
        assert_eq!(primary.group_id, GROUP_ID);
        assert_eq!(
            primary.partition,
            Some(PartitionInfo {
                fs_type: FsType::Squashfs,
                part_type: PartType::PrimarySystem,
                arch: ARCH_AMD64
            })
        );
    }

    #[test]
    fn broken_images_are_refused() {
        let partition = fake_squashfs(5000);
        let (_, good) = image(&partition);
        type Breaker = Box<dyn Fn(&mut Vec<u8>)>;
        let cases: Vec<(&str, Breaker)> = vec![
            ("magic", Box::new(|b: &mut Vec<u8>| b[32] = b'X')),
            ("version", Box::new(|b: &mut Vec<u8>| b[43] = b'2')),
            ("free count", Box::new(|b: &mut Vec<u8>| b[80] = 7)),
            ("table size", Box::new(|b: &mut Vec<u8>| b[104] = 1)),
            (
                "truncated",
                Box::new(|b: &mut Vec<u8>| b.truncate(b.len() - 10)),
            ),
            (
                "squashfs magic",
                Box::new(|b: &mut Vec<u8>| b[32768] = b'X'),
            ),
            ("header arch", Box::new(|b: &mut Vec<u8>| b[46] = b'4')),
            (
                "alignment",
                Box::new(|b: &mut Vec<u8>| {
                    // descriptor 3's offset field
                    let at = (DESCRIPTORS_OFFSET + 2 * DESCRIPTOR_SIZE + 17) as usize;
                    b[at] = 1;
                }),
            ),
            (
                "shorter than header",
                Box::new(|b: &mut Vec<u8>| b.truncate(100)),
            ),
        ];
        for (what, break_it) in cases {
            let mut bytes = good.clone();
            break_it(&mut bytes);
            assert!(
                SifImage::read(&mut Cursor::new(&bytes)).is_err(),
                "{what} not detected"
            );
        }
        assert!(SifImage::read(&mut Cursor::new(&good)).is_ok());
    }
}
