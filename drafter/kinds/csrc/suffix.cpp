// Suffix decoding's token stores (drafter/kinds/suffix.py) in C++: a store's tokens, the index of where each
// token and each adjacent pair ends, and a draft (the longest matched suffix of a context, then the most frequent
// continuation path) in one call. `NumpyTokens` in suffix.py is the reference: the same drafts, token for token
// and bit for bit in their probabilities (integer counts, one IEEE division and one product a depth, no
// contraction). Only pybind11: it builds in seconds and on any machine, the GPU's host included.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t SEPARATOR = -1;  // between two outputs in the global store (suffix.SEPARATOR)
constexpr size_t MAX_HITS = 4096;  // the most recent occurrences a match starts from (suffix.MAX_HITS)

// Absolute positions, ascending; the oldest leave from the front (a store evicts its oldest texts first).
struct Positions {
  std::vector<int64_t> at;
  size_t head = 0;

  size_t size() const { return at.size() - head; }
  int64_t front() const { return at[head]; }
  void pop_front() {
    ++head;
    if (head >= 32 && 2 * head >= at.size()) {  // compact once half is gone: amortised O(1)
      at.erase(at.begin(), at.begin() + static_cast<std::ptrdiff_t>(head));
      head = 0;
    }
  }
};

inline uint64_t pair_key(int64_t a, int64_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

template <typename Key>
void drop_front(std::unordered_map<Key, Positions>& table, Key key, int64_t pos) {
  auto it = table.find(key);
  if (it == table.end() || it->second.front() != pos) throw std::logic_error("the index forgets its oldest entries first");
  it->second.pop_front();
  if (!it->second.size()) table.erase(it);
}

using DraftOut = std::tuple<std::vector<int64_t>, std::vector<double>, int64_t>;  // tokens, p_i, match length

class Store {
 public:
  int64_t size() const { return static_cast<int64_t>(buf_.size() - head_); }
  int64_t base() const { return base_; }
  int64_t last() const {
    if (!size()) throw std::out_of_range("an empty store has no last token");
    return buf_.back();
  }

  std::vector<int32_t> slice(int64_t lo, int64_t hi) const {  // tokens [lo, hi) from the store's first
    lo = std::clamp<int64_t>(lo, 0, size());
    hi = std::clamp<int64_t>(hi, lo, size());
    return {buf_.begin() + static_cast<std::ptrdiff_t>(head_ + lo), buf_.begin() + static_cast<std::ptrdiff_t>(head_ + hi)};
  }

  // Append and index `tokens` (as TokenIndex.add: pairs never across a separator).
  void extend(const std::vector<int64_t>& tokens) {
    int64_t before = size() ? buf_.back() : SEPARATOR;
    int64_t pos = base_ + size();
    for (int64_t t : tokens) {
      if (t != SEPARATOR) {
        ones_[t].at.push_back(pos);
        if (before != SEPARATOR) pairs_[pair_key(before, t)].at.push_back(pos);
      }
      buf_.push_back(static_cast<int32_t>(t));
      before = t;
      ++pos;
    }
  }

  // Drop the oldest `count` tokens: whole texts, the last of them a separator.
  void evict(int64_t count) {
    if (count <= 0 || count > size() || at(count - 1) != SEPARATOR) throw std::invalid_argument("evict whole texts");
    int64_t before = SEPARATOR;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t t = at(i), pos = base_ + i;
      if (t != SEPARATOR) {
        drop_front(ones_, t, pos);
        if (before != SEPARATOR) drop_front(pairs_, pair_key(before, t), pos);
      }
      before = t;
    }
    head_ += static_cast<size_t>(count);
    base_ += count;
    if (2 * head_ >= buf_.size()) {
      buf_.erase(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(head_));
      head_ = 0;
    }
  }

  // The draft this store gives for the context `ctx` (another store's tokens, or this one's): suffix.draft_from.
  DraftOut draft(const Store& ctx, int64_t max_depth, int64_t k, double spec_factor, double min_prob) const {
    const int64_t len = std::min(ctx.size(), std::max<int64_t>(max_depth, 2));
    const int32_t* c = ctx.buf_.data() + ctx.buf_.size() - len;  // its last `len` tokens are all a match reads
    std::vector<int64_t> ends;
    const int64_t m = match(c, len, max_depth, ends);
    if (!m) return {{}, {}, 0};
    const int64_t limit = std::min(k, std::max<int64_t>(1, static_cast<int64_t>(spec_factor * static_cast<double>(m))));
    std::vector<int64_t> tokens;
    std::vector<double> probs;
    follow(ends, limit, min_prob, tokens, probs);
    return {std::move(tokens), std::move(probs), m};
  }

 private:
  int64_t at(int64_t i) const { return buf_[head_ + static_cast<size_t>(i)]; }

  // The most recent MAX_HITS entries of `positions`, from the store's first, without one at its last token.
  void live(const Positions* positions, std::vector<int64_t>& out) const {
    out.clear();
    if (positions == nullptr || !positions->size()) return;
    size_t hi = positions->at.size() - (positions->at.back() == base_ + size() - 1);
    size_t lo = std::max(positions->head, hi >= MAX_HITS ? hi - MAX_HITS : 0);
    for (size_t i = lo; i < hi; ++i) out.push_back(positions->at[i] - base_);
  }

  template <typename Key>
  static const Positions* find(const std::unordered_map<Key, Positions>& table, Key key) {
    auto it = table.find(key);
    return it == table.end() ? nullptr : &it->second;
  }

  // Tokens.match over the context c[0, len): the ends of the longest suffix (up to max_depth) that occurs with a
  // continuation, and its length (0: none).
  int64_t match(const int32_t* c, int64_t len, int64_t max_depth, std::vector<int64_t>& ends) const {
    if (size() < 2 || !len) return 0;
    const int64_t last = c[len - 1];
    int64_t m = 0;
    if (max_depth >= 2 && len >= 2) {
      live(find(pairs_, pair_key(c[len - 2], last)), ends);
      m = ends.empty() ? 0 : 2;
    }
    if (!m) {
      live(find(ones_, last), ends);
      m = ends.empty() ? 0 : 1;
    }
    const int64_t top = std::min(max_depth, len);
    if (m == 1 && top >= 2) return m;  // the last two tokens never occur together: nothing longer does
    std::vector<int64_t> keep;
    while (0 < m && m < top) {
      keep.clear();
      const int64_t want = c[len - 1 - m];
      for (int64_t e : ends)
        if (e - m >= 0 && at(e - m) == want) keep.push_back(e);
      if (keep.empty()) break;
      ends.swap(keep);
      ++m;
    }
    return m;
  }

  // suffix.follow: the most frequent continuation path after `ends` (the smallest token on a tie), p_i the path's
  // frequency; an occurrence whose text ends counts as a continuation no token takes.
  void follow(std::vector<int64_t> ends, int64_t limit, double min_prob, std::vector<int64_t>& tokens,
              std::vector<double>& probs) const {
    std::vector<int64_t> next;
    double p = 1.0;
    for (auto& e : ends) ++e;  // each occurrence's next position
    while (static_cast<int64_t>(tokens.size()) < limit && !ends.empty()) {
      const size_t total = ends.size();
      next.clear();
      for (int64_t at_ : ends)
        if (at_ < size() && at(at_) != SEPARATOR) next.push_back(at(at_));
      if (next.empty()) break;
      std::sort(next.begin(), next.end());
      int64_t token = next[0];
      size_t most = 0;
      for (size_t i = 0; i < next.size();) {
        size_t j = i;
        while (j < next.size() && next[j] == next[i]) ++j;
        if (j - i > most) most = j - i, token = next[i];  // strictly more: the smallest token keeps a tie
        i = j;
      }
      p *= static_cast<double>(most) / static_cast<double>(total);
      if (p < min_prob) break;
      tokens.push_back(token);
      probs.push_back(p);
      size_t kept = 0;
      for (int64_t at_ : ends)
        if (at_ < size() && at(at_) == token) ends[kept++] = at_ + 1;
      ends.resize(kept);
    }
  }

  std::vector<int32_t> buf_;  // the tokens, the live ones from head_
  size_t head_ = 0;
  int64_t base_ = 0;  // the absolute position of the first live token
  std::unordered_map<int64_t, Positions> ones_;
  std::unordered_map<uint64_t, Positions> pairs_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Store>(m, "Store", pybind11::module_local())
      .def(pybind11::init<>())
      .def("size", &Store::size)
      .def("base", &Store::base)
      .def("last", &Store::last)
      .def("slice", &Store::slice)
      .def("extend", &Store::extend)
      .def("evict", &Store::evict)
      .def("draft", &Store::draft);
}
