// Kernel binaries: kind detection, entry-name extraction (ELF cubin, fatbin, PTX) and the
// content-addressed module registry.
#include <elf.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <string_view>

#include "vitrify/graph.hpp"

namespace vitrify::graph {

const char* binary_kind_name(BinaryKind k) noexcept {
  switch (k) {
    case BinaryKind::elf: return "elf";
    case BinaryKind::fatbin: return "fatbin";
    case BinaryKind::ptx: return "ptx";
    case BinaryKind::unknown: break;
  }
  return "unknown";
}

namespace {

constexpr uint32_t kFatbinMagic = 0xBA55ED50u;
constexpr uint8_t kStoCudaEntry = 0x10;  // st_other bit nvcc sets on __global__ functions

bool is_elf(const uint8_t* p, size_t n) { return n >= 4 && std::memcmp(p, ELFMAG, SELFMAG) == 0; }

bool is_fatbin(const uint8_t* p, size_t n) {
  uint32_t m = 0;
  if (n >= 16) std::memcpy(&m, p, 4);
  return m == kFatbinMagic;
}

bool looks_like_ptx(const uint8_t* p, size_t n) {
  const size_t head = std::min<size_t>(n, 4096);
  if (head == 0) return false;
  const std::string_view s(reinterpret_cast<const char*>(p), head);
  // Text (a trailing NUL is allowed) that declares a PTX version.
  const size_t nul = s.find('\0');
  if (nul != std::string_view::npos && nul + 1 < n && s.find_first_not_of('\0', nul) != std::string_view::npos)
    return false;
  return s.find(".version") != std::string_view::npos;
}

template <typename T>
T read_at(const uint8_t* p, size_t n, uint64_t off, const char* what) {
  VITRIFY_EXPECT(off <= n && sizeof(T) <= n - off,
              std::string("malformed ELF: ") + what + " at offset " + std::to_string(off) +
                  " lies beyond the " + std::to_string(n) + "-byte image");
  T v;
  std::memcpy(&v, p + off, sizeof(T));
  return v;
}

void elf_entries(const uint8_t* p, size_t n, std::vector<std::string>& out) {
  VITRIFY_EXPECT(n >= sizeof(Elf64_Ehdr), "malformed ELF: " + std::to_string(n) +
                                           " bytes cannot hold an ELF64 header");
  VITRIFY_EXPECT(p[EI_CLASS] == ELFCLASS64 && p[EI_DATA] == ELFDATA2LSB,
              "unsupported ELF: only 64-bit little-endian cubins are read (class " +
                  std::to_string(p[EI_CLASS]) + ", data " + std::to_string(p[EI_DATA]) + ")");
  const auto eh = read_at<Elf64_Ehdr>(p, n, 0, "ELF header");
  VITRIFY_EXPECT(eh.e_shnum == 0 || eh.e_shentsize == sizeof(Elf64_Shdr),
              "malformed ELF: section header size " + std::to_string(eh.e_shentsize));
  for (uint16_t i = 0; i < eh.e_shnum; ++i) {
    const auto sh = read_at<Elf64_Shdr>(p, n, eh.e_shoff + uint64_t(i) * sizeof(Elf64_Shdr),
                                        "section header");
    if (sh.sh_type != SHT_SYMTAB) continue;
    VITRIFY_EXPECT(sh.sh_entsize == sizeof(Elf64_Sym),
                "malformed ELF: symbol size " + std::to_string(sh.sh_entsize));
    VITRIFY_EXPECT(sh.sh_link < eh.e_shnum, "malformed ELF: symbol table links to section " +
                                             std::to_string(sh.sh_link));
    const auto strs = read_at<Elf64_Shdr>(
        p, n, eh.e_shoff + uint64_t(sh.sh_link) * sizeof(Elf64_Shdr), "string table header");
    VITRIFY_EXPECT(strs.sh_offset <= n && strs.sh_size <= n - strs.sh_offset,
                "malformed ELF: string table beyond the image");
    VITRIFY_EXPECT(sh.sh_offset <= n && sh.sh_size <= n - sh.sh_offset,
                "malformed ELF: symbol table beyond the image");
    const std::string_view table(reinterpret_cast<const char*>(p + strs.sh_offset), strs.sh_size);
    for (uint64_t off = 0; off + sizeof(Elf64_Sym) <= sh.sh_size; off += sizeof(Elf64_Sym)) {
      const auto sym = read_at<Elf64_Sym>(p, n, sh.sh_offset + off, "symbol");
      if (ELF64_ST_TYPE(sym.st_info) != STT_FUNC || (sym.st_other & kStoCudaEntry) == 0) continue;
      VITRIFY_EXPECT(sym.st_name < table.size(), "malformed ELF: symbol name offset " +
                                                  std::to_string(sym.st_name) + " beyond the " +
                                                  "string table");
      const size_t end = table.find('\0', sym.st_name);
      VITRIFY_EXPECT(end != std::string_view::npos, "malformed ELF: unterminated symbol name");
      if (end > sym.st_name) out.emplace_back(table.substr(sym.st_name, end - sym.st_name));
    }
  }
}

void ptx_entries(const uint8_t* p, size_t n, std::vector<std::string>& out) {
  const std::string_view s(reinterpret_cast<const char*>(p), n);
  auto ident = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '$' || c == '.' || c == '%';
  };
  for (size_t pos = s.find(".entry"); pos != std::string_view::npos; pos = s.find(".entry", pos + 6)) {
    if (pos > 0 && !std::isspace(static_cast<unsigned char>(s[pos - 1]))) continue;
    size_t i = pos + 6;
    if (i >= s.size() || !std::isspace(static_cast<unsigned char>(s[i]))) continue;
    while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
    const size_t start = i;
    while (i < s.size() && ident(s[i])) ++i;
    if (i > start) out.emplace_back(s.substr(start, i - start));
  }
}

void fatbin_entries(const uint8_t* p, size_t n, std::vector<std::string>& out) {
  // Header: magic u32, version u16, header size u16, payload size u64. Each member: kind u16
  // (1 PTX, 2 ELF), version u16, header size u32, payload size u64, ... then the payload.
  // Compressed payloads are neither ELF nor text and are skipped.
  const uint16_t header_size = read_at<uint16_t>(p, n, 6, "fatbin header size");
  const uint64_t total = read_at<uint64_t>(p, n, 8, "fatbin size");
  uint64_t off = header_size;
  const uint64_t end = std::min<uint64_t>(n, uint64_t(header_size) + total);
  while (off + 16 <= end) {
    const uint16_t kind = read_at<uint16_t>(p, n, off, "fatbin member kind");
    const uint32_t mh = read_at<uint32_t>(p, n, off + 4, "fatbin member header size");
    const uint64_t size = read_at<uint64_t>(p, n, off + 8, "fatbin member size");
    VITRIFY_EXPECT(mh >= 16 && off + mh <= end && size <= end - off - mh,
                "malformed fatbin: member at offset " + std::to_string(off) + " (header " +
                    std::to_string(mh) + ", payload " + std::to_string(size) + ") overruns " +
                    std::to_string(end) + " bytes");
    const uint8_t* payload = p + off + mh;
    if (kind == 2 && is_elf(payload, size))
      elf_entries(payload, size, out);
    else if (kind == 1 && looks_like_ptx(payload, size))
      ptx_entries(payload, size, out);
    off += mh + size;
  }
}

}  // namespace

Hash kernel_code_hash(const void* data, size_t n, const std::string& name) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  if (!is_elf(p, n) || n < sizeof(Elf64_Ehdr) || p[EI_CLASS] != ELFCLASS64) return Hash{};
  const auto eh = read_at<Elf64_Ehdr>(p, n, 0, "ELF header");
  if (eh.e_shnum == 0 || eh.e_shentsize != sizeof(Elf64_Shdr) || eh.e_shstrndx >= eh.e_shnum)
    return Hash{};
  auto section = [&](uint32_t i) {
    VITRIFY_EXPECT(i < eh.e_shnum, "malformed ELF: section index " + std::to_string(i));
    return read_at<Elf64_Shdr>(p, n, eh.e_shoff + uint64_t(i) * sizeof(Elf64_Shdr), "section header");
  };
  auto strings = [&](const Elf64_Shdr& sh) {
    VITRIFY_EXPECT(sh.sh_offset <= n && sh.sh_size <= n - sh.sh_offset,
                "malformed ELF: string table beyond the image");
    return std::string_view(reinterpret_cast<const char*>(p + sh.sh_offset), sh.sh_size);
  };
  auto str_at = [](std::string_view t, uint32_t off) {
    if (off >= t.size()) return std::string_view();
    const size_t end = t.find('\0', off);
    return t.substr(off, (end == std::string_view::npos ? t.size() : end) - off);
  };
  const std::string_view shnames = strings(section(eh.e_shstrndx));
  auto find = [&](const std::string& want) -> int {
    for (uint32_t i = 0; i < eh.e_shnum; ++i)
      if (str_at(shnames, section(i).sh_name) == want) return int(i);
    return -1;
  };
  // The code, with the section flags (they carry the register count), the parameter bank size
  // and the relocations with symbols by name (symbol indices differ between binaries).
  const int text = find(".text." + name);
  if (text < 0) return Hash{};
  const auto ts = section(text);
  VITRIFY_EXPECT(ts.sh_offset <= n && ts.sh_size <= n - ts.sh_offset,
              "malformed ELF: .text." + name + " beyond the image");
  Sha256 h;
  h.update(name.data(), name.size());
  h.update(&ts.sh_flags, sizeof ts.sh_flags);
  h.update(&ts.sh_size, sizeof ts.sh_size);
  h.update(p + ts.sh_offset, ts.sh_size);
  if (const int c0 = find(".nv.constant0." + name); c0 >= 0) {
    const uint64_t size = section(c0).sh_size;
    h.update(&size, sizeof size);
  }
  for (const char* prefix : {".rela.text.", ".rel.text."}) {
    const int r = find(prefix + name);
    if (r < 0) continue;
    const auto rs = section(r);
    const bool rela = prefix[4] == 'a';
    const size_t entry = rela ? sizeof(Elf64_Rela) : sizeof(Elf64_Rel);
    VITRIFY_EXPECT(rs.sh_offset <= n && rs.sh_size <= n - rs.sh_offset,
                "malformed ELF: relocations of " + name + " beyond the image");
    const auto symtab = section(rs.sh_link);
    const std::string_view symnames = strings(section(symtab.sh_link));
    for (uint64_t off = 0; off + entry <= rs.sh_size; off += entry) {
      Elf64_Rela rel{};
      if (rela) {
        rel = read_at<Elf64_Rela>(p, n, rs.sh_offset + off, "relocation");
      } else {
        const auto r0 = read_at<Elf64_Rel>(p, n, rs.sh_offset + off, "relocation");
        rel.r_offset = r0.r_offset;
        rel.r_info = r0.r_info;
      }
      const uint64_t type = ELF64_R_TYPE(rel.r_info);
      const int64_t addend = rel.r_addend;
      const auto sym = read_at<Elf64_Sym>(
          p, n, symtab.sh_offset + uint64_t(ELF64_R_SYM(rel.r_info)) * sizeof(Elf64_Sym), "symbol");
      const std::string_view target = ELF64_ST_TYPE(sym.st_info) == STT_SECTION
                                          ? str_at(shnames, section(sym.st_shndx).sh_name)
                                          : str_at(symnames, sym.st_name);
      h.update(&rel.r_offset, sizeof rel.r_offset);
      h.update(&type, sizeof type);
      h.update(&addend, sizeof addend);
      h.update(target.data(), target.size());
      h.update("", 1);
    }
  }
  return h.finish();
}

BinaryKind detect_binary_kind(const void* data, size_t n) noexcept {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  if (is_elf(p, n)) return BinaryKind::elf;
  if (is_fatbin(p, n)) return BinaryKind::fatbin;
  if (looks_like_ptx(p, n)) return BinaryKind::ptx;
  return BinaryKind::unknown;
}

std::vector<std::string> kernel_names(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  std::vector<std::string> out;
  switch (detect_binary_kind(data, n)) {
    case BinaryKind::elf: elf_entries(p, n, out); break;
    case BinaryKind::fatbin: fatbin_entries(p, n, out); break;
    case BinaryKind::ptx: ptx_entries(p, n, out); break;
    case BinaryKind::unknown: break;
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// ---------------------------------------------------------------------------------- registry
Hash ModuleRegistry::add(const void* data, size_t n) {
  VITRIFY_EXPECT(data != nullptr || n == 0, "ModuleRegistry::add: null data of " + std::to_string(n) +
                                             " bytes");
  const Hash h = sha256(data, n);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (modules_.count(h)) return h;
  }
  // Parse outside the lock: a malformed binary is still recorded (it may load fine), with no
  // kernel names, so a graph using it fails at FREEZE naming the kernel rather than here.
  auto m = std::make_shared<Module>();
  m->hash = h;
  m->kind = detect_binary_kind(data, n);
  m->bytes.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + n);
  try {
    m->kernels = kernel_names(data, n);
  } catch (const std::invalid_argument&) {
    m->kernels.clear();
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (modules_.count(h)) return h;
  for (const std::string& k : m->kernels) by_kernel_.emplace(k, h);
  total_bytes_ += n;
  modules_.emplace(h, std::move(m));
  return h;
}

bool ModuleRegistry::contains(const Hash& h) const {
  std::lock_guard<std::mutex> lock(mu_);
  return modules_.count(h) != 0;
}

std::shared_ptr<const Module> ModuleRegistry::get(const Hash& h) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = modules_.find(h);
  return it == modules_.end() ? nullptr : it->second;
}

std::vector<Hash> ModuleRegistry::modules_with_kernel(const std::string& kernel) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Hash> out;
  auto [lo, hi] = by_kernel_.equal_range(kernel);
  for (auto it = lo; it != hi; ++it) out.push_back(it->second);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<Hash> ModuleRegistry::hashes() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Hash> out;
  for (const auto& [h, m] : modules_) out.push_back(h);
  return out;
}

size_t ModuleRegistry::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return modules_.size();
}

size_t ModuleRegistry::total_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return total_bytes_;
}

void ModuleRegistry::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  modules_.clear();
  by_kernel_.clear();
  total_bytes_ = 0;
}

}  // namespace vitrify::graph
