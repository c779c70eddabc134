#include "worker/output_norms.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "common/codec.h"

namespace geotrain {
namespace {

// An activation message of `values` encoded with `codec`, and an int64
// tensor after it (targets), which the RMS leaves out.
LinkMessage Activation(const std::vector<float>& values, v1::Codec codec, bool zstd = false) {
  LinkMessage message;
  message.header.set_kind(v1::MESSAGE_KIND_ACTIVATION);
  v1::TensorHeader* t = message.header.add_tensors();
  t->add_shape(static_cast<int64_t>(values.size()));
  t->set_dtype(v1::DTYPE_FLOAT32);
  t->set_codec(codec);
  std::string encoded;
  if (codec == v1::CODEC_NONE) {
    encoded.assign(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  } else {
    t->set_block_size(64);
    auto c = MakeCodec(codec);
    EXPECT_TRUE(c.ok());
    EXPECT_TRUE((*c)->Encode(values.data(), values.size(), &encoded).ok());
  }
  t->set_encoded_bytes(encoded.size());
  if (zstd) {
    std::string compressed;
    EXPECT_TRUE(ZstdCompress(encoded, 1, &compressed).ok());
    encoded = compressed;
    t->set_zstd(true);
  }
  t->set_payload_bytes(encoded.size());
  message.payload = encoded;
  v1::TensorHeader* targets = message.header.add_tensors();
  targets->add_shape(2);
  targets->set_dtype(v1::DTYPE_INT64);
  targets->set_codec(v1::CODEC_NONE);
  targets->set_payload_bytes(16);
  message.payload.append(16, '\x7f');
  return message;
}

std::vector<float> Ramp(int n, float scale) {
  std::vector<float> v;
  for (int i = 0; i < n; ++i) v.push_back(scale * std::sin(0.37f * i));
  return v;
}

double ExactRms(const std::vector<float>& v) {
  double sum = 0;
  for (float x : v) sum += static_cast<double>(x) * x;
  return std::sqrt(sum / v.size());
}

// The receiver's figure is the values' RMS under every codec (to the
// codec's rounding), with zstd around it or not; the targets are left out.
TEST(OutputNormsTest, RmsOfTheDecodedValuesUnderEveryCodec) {
  const std::vector<float> values = Ramp(1000, 2.5f);
  const double exact = ExactRms(values);
  for (v1::Codec codec : {v1::CODEC_NONE, v1::CODEC_FP16, v1::CODEC_BF16, v1::CODEC_INT8,
                          v1::CODEC_INT4}) {
    for (bool zstd : {false, true}) {
      auto rms = FloatRms(Activation(values, codec, zstd));
      ASSERT_TRUE(rms.ok()) << CodecName(codec) << " " << rms.status();
      EXPECT_NEAR(*rms, exact, codec == v1::CODEC_INT4 ? 0.05 * exact : 0.01 * exact)
          << CodecName(codec) << (zstd ? " zstd" : "");
    }
  }
}

TEST(OutputNormsTest, AMalformedMessageIsAnErrorAndTheMeterIgnoresIt) {
  LinkMessage message = Activation(Ramp(100, 1), v1::CODEC_INT8);
  message.payload.resize(10);
  EXPECT_FALSE(FloatRms(message).ok());
  OutputNormMeter meter;
  meter.Observe(message);
  EXPECT_EQ(meter.messages(), 0u);
}

// A moving average over training messages; other kinds are not measured.
TEST(OutputNormsTest, TheMeterAveragesTrainingMessagesOnly) {
  OutputNormMeter meter(/*weight=*/0.5);
  meter.Observe(Activation(Ramp(256, 1), v1::CODEC_NONE));
  const double first = meter.rms();
  EXPECT_NEAR(first, ExactRms(Ramp(256, 1)), 1e-6);
  meter.Observe(Activation(Ramp(256, 3), v1::CODEC_NONE));
  EXPECT_NEAR(meter.rms(), 2 * first, 1e-6);
  LinkMessage eval = Activation(Ramp(256, 100), v1::CODEC_NONE);
  eval.header.set_kind(v1::MESSAGE_KIND_EVAL);
  meter.Observe(eval);
  EXPECT_EQ(meter.messages(), 2u);
  EXPECT_NEAR(meter.rms(), 2 * first, 1e-6);
}

// Each sampled step (a multiple of 8) gets the RMS of its own messages,
// reported once a later step's message has arrived; the other steps only
// feed the moving average. At most the newest 16 are reported.
TEST(OutputNormsTest, SampledStepsAreReportedOnceComplete) {
  OutputNormMeter meter;
  auto at_step = [](int step, float scale) {
    LinkMessage m = Activation(Ramp(256, scale), v1::CODEC_NONE);
    m.header.set_step(step);
    return m;
  };
  const double unit = ExactRms(Ramp(256, 1));
  meter.Observe(at_step(8, 1));
  meter.Observe(at_step(8, 3));
  EXPECT_TRUE(meter.CompleteSamples().empty());  // step 8 may have more to come
  meter.Observe(at_step(9, 100));                 // not sampled
  std::vector<StepRms> samples = meter.CompleteSamples();
  ASSERT_EQ(samples.size(), 1u);
  EXPECT_EQ(samples[0].step, 8);
  EXPECT_EQ(samples[0].messages, 2u);
  EXPECT_NEAR(samples[0].rms, unit * std::sqrt((1.0 + 9.0) / 2), 1e-5);
  for (int step = 16; step <= 8 * 30; step += 8) meter.Observe(at_step(step, 2));
  samples = meter.CompleteSamples();
  ASSERT_EQ(samples.size(), OutputNormMeter::kReportedSamples);
  EXPECT_EQ(samples.front().step, 8 * 14);
  EXPECT_EQ(samples.back().step, 8 * 29);  // 240 is the newest: not complete
  EXPECT_NEAR(samples.back().rms, 2 * unit, 1e-5);
}

}  // namespace
}  // namespace geotrain
